"""Start accuracy of a preset's task: greedy and sampled, before any RL step.

    python benchmarks/task_start.py                       # smollm2-arith, 64 prompts, 4 samples each
    python benchmarks/task_start.py --prompts 128 --json benchmarks/results/task_start.json

The prompts are the preset's own (its task, template, chat template and response budget), drawn
with seeds the training runs do not use; responses come from the unquantized engine in fp32 (the
trainer's precision) and are scored with the preset's reward. Prints one table row per mode.
"""

from __future__ import annotations

import argparse
import json
import time

from flashrl.core.sampling import SamplingParams
from flashrl.engine.engine import Engine, EngineConfig
from flashrl.fileio import atomic_write_text
from flashrl.rl.config_build import build_config
from flashrl.rl.data import prompt_source, render_prompt
from flashrl.rl.presets import resolve_model
from flashrl.rl.rewards import get_reward


def measure(preset: str, prompts: int, samples: int, seed: int) -> list[dict]:
    config = build_config(preset, None, {})
    a, d = config.algo, config.data
    engine_config = EngineConfig(
        dtype="fp32",
        max_batch=prompts * samples,
        max_len=a.max_prompt_tokens + a.max_response_tokens,
        progress=False,
    )
    engine = Engine(resolve_model(config.model), "bf16", engine_config)
    tok = engine.tokenizer
    examples = prompt_source(d, seed=seed).batch(0, prompts)
    ids = [
        tok(
            render_prompt(tok, ex.prompt, d.chat_template, d.system_prompt),
            add_special_tokens=False,
        )["input_ids"][-a.max_prompt_tokens :]
        for ex in examples
    ]
    reward = get_reward(d.reward)
    rows = []
    modes = (("greedy", 1, 1), (f"sampled T={a.temperature:g}", a.temperature, samples))
    for mode, temperature, n in modes:
        top_k = 1 if mode == "greedy" else a.top_k
        params = SamplingParams(
            temperature=temperature, top_k=top_k, max_tokens=a.max_response_tokens, n=n, seed=seed
        )
        start = time.perf_counter()
        outs = engine.generate(ids, params)
        scores = [reward(o.text, examples[o.prompt_index].answer) for o in outs]
        rows.append(
            dict(
                preset=preset,
                mode=mode,
                responses=len(outs),
                accuracy=sum(scores) / len(scores),
                truncated=sum(o.finish_reason == "length" for o in outs) / len(outs),
                mean_tokens=sum(len(o.response_ids) for o in outs) / len(outs),
                seconds=time.perf_counter() - start,
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-arith")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = measure(args.preset, args.prompts, args.samples, args.seed)
    print("| mode | responses | accuracy | truncated | mean tokens |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['responses']} | {r['accuracy']:.3f} | {r['truncated']:.2f} "
            f"| {r['mean_tokens']:.1f} |"
        )
    if args.json:
        atomic_write_text(args.json, json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
