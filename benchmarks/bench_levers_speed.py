"""Decode speed of the mismatch levers against plain int8, in one run (paired rounds).

    python benchmarks/bench_levers_speed.py --threads 2
    python benchmarks/bench_levers_speed.py --variants int8,int8_g64 --rounds 5

Variants are written as in benchmarks/mismatch.py (a scheme, optionally ``+sqA`` for online
smoothing with exponent A), and ``+nomirror`` turns off the CPU engine's fp32 weight copies
(`flashrl.quant.cpu_mirror`), e.g. ``--variants int8,int8+nomirror``: then the responses of each
pair are compared token for token (the copies must not change a bit). Every engine is built and warmed up first (for smoothed engines the
warm-up generate also runs the calibration); then each round generates the same batch once with
every variant in turn (EOS ignored, fixed length), so a noisy neighbour slows all variants of a
round alike. Reported: median tokens/s over rounds and its ratio to the first variant, per round
ratios' median too (table + JSON, default results/levers_speed.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from _common import device_name, format_table, write_json
from flashrl.core.config import RolloutConfig
from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.quant.cpu_mirror import enable_mirrors
from flashrl.rl.presets import resolve_model
from mismatch import prompts_for


def build(model_dir, variant: str, batch: int, max_len: int) -> Engine:
    name, _, sq = variant.replace("+nomirror", "").partition("+sq")
    config = RolloutConfig(quant=name, smooth=float(sq) if sq else None)
    engine = Engine(
        model_dir,
        config,
        EngineConfig(dtype="bf16", max_len=max_len, max_batch=batch, progress=False),
    )
    if variant.endswith("+nomirror"):
        enable_mirrors(engine.model, budget_bytes=0)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--variants", default="int8,int8_g128,int8_g64,int8+sq0.5,int8_g64+sq0.5")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/levers_speed.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    engines = {v: build(model_dir, v, args.batch, 128 + args.tokens) for v in variants}
    prompts = (prompts_for(engines[variants[0]], 16) * args.batch)[: args.batch]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    for engine in engines.values():  # warm-up (and the smoothing calibration)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, seed=1))
    speeds: dict[str, list[float]] = {v: [] for v in variants}
    responses: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for v, engine in engines.items():
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            speeds[v].append(sum(len(o.response_ids) for o in outs) / (time.perf_counter() - start))
            responses[v] = [o.response_ids for o in outs]
    for v in variants:
        if v.endswith("+nomirror") and v.removesuffix("+nomirror") in responses:
            same = responses[v] == responses[v.removesuffix("+nomirror")]
            print(
                f"{v}: responses {'identical to' if same else 'DIFFER from'} the mirrored engine's"
            )
    base = speeds[variants[0]]
    rows = [{
        "variant": v,
        "tokens_per_s": statistics.median(s),
        "ratio": statistics.median(s) / statistics.median(base),
        "paired_ratio": statistics.median(a / b for a, b in zip(s, base)),
        "rounds": s,
    } for v, s in speeds.items()]  # fmt: skip
    payload = {"device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
               "batch": args.batch, "tokens": args.tokens, "rows": rows}  # fmt: skip
    write_json(Path(args.out), payload)
    print(format_table(rows, ["variant", "tokens_per_s", "ratio", "paired_ratio"]))


if __name__ == "__main__":
    main()
