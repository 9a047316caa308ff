"""Time flashrl.correction on a large batch on CPU: weights + rejection + metrics per config.

    python benchmarks/bench_correction.py                       # 512 x 8192, prints a table
    python benchmarks/bench_correction.py --threads 2,1         # once per intra-op thread count
    python benchmarks/bench_correction.py --batch 64 --tokens 1024 --repeat 3

Inputs are synthetic: ragged response lengths (uniform in [1, tokens]), rollout logprobs drawn from
-Exponential(1), trainer logprobs = rollout + N(0, sigma), capped at 0. The cost does not depend on the
values, only on the shape and the config. Writes benchmarks/results/correction.json.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from _common import device_name, format_table, time_fn, write_json
from flashrl.correction import CorrectionConfig, compute_correction, mismatch_metrics
from flashrl.rl.loss import ppo_clip_loss

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
    "bypass + token_k1": CorrectionConfig(mode="bypass", rejection=("token_k1",)),
}


def make_inputs(
    batch: int, tokens: int, sigma: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (batch, 1), generator=gen)
    mask = torch.arange(tokens) < lengths
    roll = -torch.empty(batch, tokens).exponential_(1.0, generator=gen)
    train = (roll + sigma * torch.randn(batch, tokens, generator=gen)).clamp(max=0.0)
    return train, roll, mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=512, help="sequences per batch")
    parser.add_argument("--tokens", type=int, default=8192, help="padded response length")
    parser.add_argument(
        "--sigma", type=float, default=0.2, help="std of trainer - rollout logprob noise"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed calls per row (after 2 warm-up calls)"
    )
    parser.add_argument(
        "--threads", default=str(torch.get_num_threads()), help="comma-separated thread counts"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/correction.json")
    args = parser.parse_args(argv)

    cpu = torch.device("cpu")
    device = device_name(cpu)  # before the loop changes the thread count it reports
    load_before = os.getloadavg()[0]
    train, roll, mask = make_inputs(args.batch, args.tokens, args.sigma, args.seed)
    positions = train.numel()
    corr = compute_correction(train, roll, mask)
    advantages = torch.randn(args.batch)
    rows = []

    def record(name: str, fn: Callable[[], object]) -> None:
        calls = 2 + args.repeat  # time_fn's warm-up calls + timed calls
        cpu_start = time.process_time()
        seconds = time_fn(fn, cpu, repeat=args.repeat)
        cpu_seconds = (time.process_time() - cpu_start) / calls
        rows.append(
            {
                "what": name,
                "threads": torch.get_num_threads(),
                "wall_ms": round(seconds * 1e3, 1),
                "cpu_ms": round(cpu_seconds * 1e3, 1),
                "Mpos_per_s": round(positions / seconds / 1e6, 1),
            }
        )
        print(f"{name:<50} {torch.get_num_threads()} threads {seconds * 1e3:8.1f} ms", flush=True)

    def loss_fwd_bwd() -> None:
        lp = train.clone().requires_grad_(True)
        loss, _ = ppo_clip_loss(lp, train, advantages, corr.mask, corr.weights, dual_clip=10.0)
        loss.backward()

    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, cfg in CONFIGS.items():
            record(
                f"compute_correction: {name}",
                lambda cfg=cfg: compute_correction(train, roll, mask, cfg),
            )
        record("mismatch_metrics only", lambda: mismatch_metrics(train, roll, mask))
        record("ppo_clip_loss forward + backward", loss_fwd_bwd)

    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"\n{args.batch} x {args.tokens} = {positions:,} positions, {int(mask.sum()):,} valid tokens, "
          f"kl = {corr.metrics['kl']:.4f}")  # fmt: skip
    print(
        f"{device}, torch {torch.__version__}, 1-min load average before/after {load[0]}/{load[1]}"
    )
    print("wall_ms: median wall time per call; cpu_ms: process CPU time per call, all threads\n")
    print(format_table(rows, ["what", "threads", "wall_ms", "cpu_ms", "Mpos_per_s"]))
    command = (
        f"python benchmarks/bench_correction.py --batch {args.batch} --tokens {args.tokens} --sigma {args.sigma} "
        f"--repeat {args.repeat} --threads {args.threads}"
    )
    path = write_json(args.out, {
        "benchmark": "correction",
        "command": command,
        "device": device,
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg_1min_before_after": load,
        "shape": [args.batch, args.tokens],
        "valid_tokens": int(mask.sum()),
        "mismatch_kl": corr.metrics["kl"],
        "rows": rows,
    })  # fmt: skip
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
