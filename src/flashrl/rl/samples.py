"""What the model wrote: a few rollouts per step in ``samples.jsonl``, and a short printout.

Each line is one sampled response: step, prompt (as rendered, chat template included), response,
reward, reference answer, whether it was truncated at the response budget, its length in tokens and
the mean per-token logprob under the rollout engine and under the trainer (their gap is the
sample's share of the rollout/trainer mismatch). Samples are taken one per prompt group, spread
over the batch, so one step's lines show different prompts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from flashrl.rl.durable import append_line

SAMPLES_FILE = "samples.jsonl"


@dataclass
class Sample:
    step: int
    prompt: str
    response: str
    reward: float
    answer: str
    truncated: bool
    response_tokens: int
    rollout_logprob_mean: float
    trainer_logprob_mean: float | None
    """None for a rollout dropped before the update (dynamic sampling): it was never scored."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def pick(num_rollouts: int, group_size: int, count: int) -> list[int]:
    """Indices of `count` rollouts, the first of evenly spaced prompt groups."""
    groups = num_rollouts // group_size
    count = min(count, groups)
    if count <= 0:
        return []
    stride = groups / count
    return [int(k * stride) * group_size for k in range(count)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def format_samples(samples: list[Sample], width: int = 160) -> str:
    """A few lines for the console: reward, length, prompt tail and response head."""
    lines = []
    for s in samples:
        prompt = " ".join(s.prompt.split())[-60:]
        response = " ".join(s.response.split())
        if len(response) > width:
            response = response[: width - 3] + "..."
        cut = " (truncated)" if s.truncated else ""
        lines.append(
            f"  step {s.step} reward {s.reward:g} [{s.response_tokens} tok{cut}] "
            f"...{prompt!r} -> {response!r} (answer {s.answer})"
        )
    return "\n".join(lines)


def collect(
    step: int,
    prompts: list[str],
    answers: list[str],
    rollouts: list,
    scores: list[float],
    trainer_means: dict[int, float],
    group_size: int,
    count: int,
) -> list[Sample]:
    """`count` samples of one step: `prompts` / `answers` per prompt group, `scores` per rollout,
    `trainer_means` the trainer's mean logprob by rollout index (rollouts it scored)."""
    out = []
    for i in pick(len(rollouts), group_size, count):
        r = rollouts[i]
        out.append(
            Sample(
                step=step,
                prompt=prompts[r.prompt_index],
                response=r.text,
                reward=float(scores[i]),
                answer=answers[r.prompt_index],
                truncated=r.finish_reason == "length",
                response_tokens=len(r.response_ids),
                rollout_logprob_mean=mean(list(r.logprobs)),
                trainer_logprob_mean=trainer_means.get(i),
            )
        )
    return out


def record_samples(path: Path, samples: list[Sample], print_now: bool = False) -> None:
    """Append `samples` to samples.jsonl (one fsynced line each); print three when `print_now`."""
    for sample in samples:
        append_line(path, sample.to_json())
    if print_now and samples:
        tqdm.write(format_samples(samples[:3]))
