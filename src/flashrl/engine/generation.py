"""The two ends of a `generate` call: its requests (one per prompt and sample), and the `Rollout`s
of the finished requests; plus the progress bar shown while it runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from tqdm.auto import tqdm

from flashrl.core.rollout import Rollout
from flashrl.core.sampling import SamplingParams
from flashrl.engine.sampler import SamplingTables
from flashrl.engine.scheduler import Request


def build_requests(
    encoded: list[list[int]], params: SamplingParams, tables: SamplingTables, max_len: int
) -> Iterator[list[Request]]:
    """The requests of each prompt (its `params.n` samples), prompt by prompt; request (i, j) is
    row ``i * n + j`` of `tables`."""
    for i, ids in enumerate(encoded):
        max_new = min(params.max_tokens, max_len - len(ids))
        yield [Request(i, j, ids, i * params.n + j, tables, max_new) for j in range(params.n)]


def to_rollouts(
    done: list[Request], tables: SamplingTables, params: SamplingParams, tokenizer: Any
) -> list[Rollout]:
    """The rollouts of the finished requests, prompt-major (one device-to-host copy per table)."""
    done = sorted(done, key=lambda r: (r.prompt_index, r.sample_index))
    logprobs = tables.logprobs.cpu() if params.logprobs else None
    raw = tables.raw_logprobs.cpu() if tables.raw_logprobs is not None else None
    rollouts = []
    for r in done:
        n = len(r.response)
        text = "" if tokenizer is None else tokenizer.decode(r.response, skip_special_tokens=True)
        rollouts.append(
            Rollout(
                prompt_ids=list(r.prompt_ids),
                response_ids=list(r.response),
                text=text,
                logprobs=logprobs[r.index, :n].tolist() if logprobs is not None else [],
                finish_reason=r.finish_reason or "length",
                raw_logprobs=raw[r.index, :n].tolist() if raw is not None else None,
                prompt_index=r.prompt_index,
                sample_index=r.sample_index,
            )
        )
    return rollouts


class GenerateProgress:
    """A tqdm bar of finished sequences with the generated tokens/s, shown only for calls longer
    than `DELAY_S` seconds and refreshed at least every second while nothing finishes."""

    DELAY_S = 2.0

    def __init__(self, total: int, enabled: bool, generated_tokens: Callable[[], float]) -> None:
        self.bar = tqdm(
            total=total,
            unit="seq",
            desc="generate",
            delay=self.DELAY_S,
            disable=not enabled,
            leave=False,
        )
        self.generated_tokens, self.before = generated_tokens, generated_tokens()
        self.start = self.shown = time.perf_counter()

    def update(self, finished: list[Request]) -> None:
        now = time.perf_counter()
        if not finished and now - self.shown < 1.0:
            return
        rate = (self.generated_tokens() - self.before) / max(now - self.start, 1e-9)
        self.bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
        if finished:
            self.bar.update(len(finished))
        elif now - self.start >= self.DELAY_S:
            self.bar.refresh()
        self.shown = now

    def close(self) -> None:
        self.bar.close()


class Counters:
    """The engine's running totals (counts and seconds) that `Engine.stats` reports."""

    NAMES = (
        "load_s", "generate_calls", "prompts", "sequences", "prompt_tokens", "generated_tokens",
        "generate_s", "prefill_forwards", "prefill_s", "decode_s", "decode_steps",
        "weight_updates", "weight_update_s", "transfer_s", "requantize_s",
    )  # fmt: skip

    def __init__(self, **initial: float) -> None:
        self.values: dict[str, float] = dict.fromkeys(self.NAMES, 0.0)
        self.add(**initial)

    def add(self, **amounts: float) -> None:
        """Add each amount to its total (a name outside `NAMES` is an internal bug)."""
        for name, amount in amounts.items():
            assert name in self.values, name
            self.values[name] += amount
