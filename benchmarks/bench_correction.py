"""Time flashrl.correction on a large batch on CPU: weights + rejection + metrics per config.

    python benchmarks/bench_correction.py                       # 512 x 8192, prints a table
    python benchmarks/bench_correction.py --threads 2,1         # once per intra-op thread count
    python benchmarks/bench_correction.py --batch 64 --tokens 1024 --repeats 3

Inputs are synthetic: ragged response lengths (uniform in [1, tokens]), rollout logprobs drawn from
-Exponential(1), trainer logprobs = rollout + N(0, sigma), capped at 0. The cost does not depend on the
values, only on the shape and the config. Writes benchmarks/results/correction.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flashrl.correction import CorrectionConfig, compute_correction, mismatch_metrics, ppo_clip_loss

ALL_OPTIONS = {
    "token_k1": (0.5, 2.0),
    "token_k2": 2.0,
    "token_k3": 1.0,
    "seq_sum_k1": (0.5, 2.0),
    "seq_sum_k2": 3.0,
    "seq_sum_k3": 3.0,
    "seq_mean_k1": (0.9, 1.1),
    "seq_mean_k2": 2.0,
    "seq_mean_k3": 0.01,
    "seq_max_k2": 8.0,
    "seq_max_k3": 8.0,
}

CONFIGS: dict[str, CorrectionConfig] = {
    "token_tis (default, C=2)": CorrectionConfig(),
    "token_mis (IcePop 0.5-5)": CorrectionConfig(weight="token_mis"),
    "seq_tis (C=2)": CorrectionConfig(weight="seq_tis"),
    "seq_mis (0.5-2)": CorrectionConfig(weight="seq_mis", band=(0.5, 2.0)),
    "token_tis + Geo-RS + K3": CorrectionConfig(rejection=("seq_mean_k1", "seq_mean_k3")),
    "token_tis + batch_normalize": CorrectionConfig(batch_normalize=True),
    "token_tis + all 11 rejection options": CorrectionConfig(
        rejection=tuple(ALL_OPTIONS), rejection_thresholds=tuple(ALL_OPTIONS.values())
    ),
    "bypass (metrics-only weights) + token_k1": CorrectionConfig(mode="bypass", rejection=("token_k1",)),
}


def make_inputs(batch: int, tokens: int, sigma: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (batch, 1), generator=gen)
    mask = torch.arange(tokens) < lengths
    roll = -torch.empty(batch, tokens).exponential_(1.0, generator=gen)
    train = (roll + sigma * torch.randn(batch, tokens, generator=gen)).clamp(max=0.0)
    return train, roll, mask


def time_it(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=512, help="sequences per batch")
    parser.add_argument("--tokens", type=int, default=8192, help="padded response length")
    parser.add_argument("--sigma", type=float, default=0.2, help="std of trainer - rollout logprob noise")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", default=str(torch.get_num_threads()), help="comma-separated torch intra-op thread counts"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "correction.json")
    args = parser.parse_args(argv)

    train, roll, mask = make_inputs(args.batch, args.tokens, args.sigma, args.seed)
    positions, valid = train.numel(), int(mask.sum())
    corr = compute_correction(train, roll, mask)
    advantages = torch.randn(args.batch)
    rows = []

    def record(name: str, fn: Callable[[], object]) -> None:
        times = time_it(fn, args.repeats)
        median = statistics.median(times)
        rows.append(
            {
                "name": name,
                "threads": torch.get_num_threads(),
                "median_ms": round(median * 1e3, 1),
                "min_ms": round(min(times) * 1e3, 1),
                "mpositions_per_s": round(positions / median / 1e6, 1),
            }
        )
        print(f"{name:<62} {torch.get_num_threads()} threads {median * 1e3:8.1f} ms", flush=True)

    def loss_fwd_bwd() -> None:
        lp = train.clone().requires_grad_(True)
        loss, _ = ppo_clip_loss(lp, train, advantages, corr.mask, corr.weights, dual_clip=10.0)
        loss.backward()

    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, cfg in CONFIGS.items():
            record(f"compute_correction: {name}", lambda cfg=cfg: compute_correction(train, roll, mask, cfg))
        record("mismatch_metrics only", lambda: mismatch_metrics(train, roll, mask))
        record("ppo_clip_loss forward + backward", loss_fwd_bwd)

    kl = corr.metrics["kl"]
    print(f"\n{args.batch} x {args.tokens} = {positions:,} positions, {valid:,} valid tokens, kl = {kl:.4f}")
    print(f"CPU: {cpu_model()}, torch {torch.__version__}\n")
    print(f"| {'what':<62} | threads | median ms | min ms | M positions/s |")
    print(f"|{'-' * 64}|---------|-----------|--------|---------------|")
    for r in rows:
        cells = (f"{r['threads']:>7}", f"{r['median_ms']:>9}", f"{r['min_ms']:>6}", f"{r['mpositions_per_s']:>13}")
        print(f"| {r['name']:<62} | " + " | ".join(cells) + " |")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "correction",
        "command": "python benchmarks/bench_correction.py "
        + f"--batch {args.batch} --tokens {args.tokens} --sigma {args.sigma} --repeats {args.repeats} "
        + f"--threads {args.threads}",
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "shape": [args.batch, args.tokens],
        "valid_tokens": valid,
        "mismatch_kl": kl,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
