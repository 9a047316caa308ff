"""Where a decode step's device time goes, per scheme: GEMMs, attention, fused elementwise and
quantization kernels, the rest. Written for the question the H200 run left open: with CUDA graphs
8-bit steps take as long as bf16 ones although they read 43% fewer weight bytes.

Each scheme: one engine, a warm-up generate (compiles and captures every shape), then
`torch.profiler` over a generate of `--output-len` tokens and over one of a single token (the
prefill alone); decode = the difference, divided by the decode steps. Kernels are grouped by name.

    python benchmarks/profile_decode_step.py --random-weights qwen2.5-7b --quant bf16,fp8,int8 \\
        --batch 64 --prompt-len 256 --output-len 64 --compile reduce-overhead --device cuda

On CPU (a check that the script runs; CPU op times, not kernels) use `--random-weights tiny-bench`.
Writes a table to stdout and JSON to `--out` after every scheme (a run cut off keeps what it did).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.fileio import atomic_write_text
from flashrl.tools.bench_configs import random_model_dir

CATEGORIES = (  # first match wins; names as CUPTI reports them (cuBLASLt, CUTLASS, flash, inductor)
    (
        "gemm",
        re.compile(
            r"gemm|cutlass|xmma|nvjet|cublas|scaled_mm|_mm_|matmul|addmm|aten::mm|linear", re.I
        ),
    ),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
    ("quantize", re.compile(r"quant|amax|scale|float8|fp8|int8|round", re.I)),
    (
        "fused elementwise",
        re.compile(r"triton|elementwise|vectorized|reduce|norm|rope|silu|cat|copy", re.I),
    ),
)


def category(name: str) -> str:
    return next((cat for cat, pattern in CATEGORIES if pattern.search(name)), "other")


# CUPTI's own bookkeeping and range annotations: device-side entries that are not kernels
NOT_KERNELS = re.compile(
    r"^(## |ProfilerStep|cuLaunch|Command Buffer Full|Buffer Flush|Activity Buffer)"
)


def kernel_times_us(events, device: str) -> dict[str, float]:
    """Self time per kernel (CUDA) or per op (CPU), microseconds, summed over calls.

    On CUDA only device events count: a CPU op's self device time is its kernels' time again
    (counting both doubled aten::cumsum), and a graph replay's `## Call CompiledFxGraph` range
    spans the kernels it launched (counting it added about the whole step a second time)."""
    times: dict[str, float] = defaultdict(float)
    for event in events:
        if device == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = event.self_device_time_total
        else:
            t = event.self_cpu_time_total
        if t > 0 and not NOT_KERNELS.match(event.key):
            times[event.key] += t
    return times


def wall_s(engine: Engine, prompts: list[list[int]], tokens: int, device: str) -> float:
    """Seconds of one generate, unprofiled (the kernel sum says nothing of gaps between kernels)."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def profiled(
    engine: Engine, prompts: list[list[int]], tokens: int, device: str
) -> dict[str, float]:
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
    return kernel_times_us(prof.key_averages(), device)


def profile_scheme(model_dir: Path, scheme: str, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        dtype="bf16", device=args.device, max_batch=args.batch, progress=False,
        max_len=args.prompt_len + args.output_len, load_weights=False,
        decode_compile=None if args.compile == "none" else args.compile,
    )  # fmt: skip
    engine = Engine(model_dir, scheme, config)
    engine.init_random_weights_(seed=0)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    warm = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0)
    engine.generate(prompts, warm)  # compiles and captures every decode shape of the timed runs
    full = profiled(engine, prompts, args.output_len, args.device)
    prefill = profiled(engine, prompts, 1, args.device)
    steps = args.output_len - 1
    wall_us = (
        min(  # best of 3: the machine's noise only adds
            wall_s(engine, prompts, args.output_len, args.device)
            - wall_s(engine, prompts, 1, args.device)
            for _ in range(3)
        )
        / steps
        * 1e6
    )
    per_step = {k: (full[k] - prefill.get(k, 0.0)) / steps for k in full}
    by_category: dict[str, float] = defaultdict(float)
    for name, t in per_step.items():
        by_category[category(name)] += t
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]
    del engine
    return {
        "scheme": scheme,
        "decode_us_per_step": sum(per_step.values()),
        "wall_us_per_step": wall_us,
        "by_category_us": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_us": [{"name": n, "us_per_step": t, "category": category(n)} for n, t in top],
    }


def report(row: dict) -> str:
    kernels, wall = row["decode_us_per_step"], row["wall_us_per_step"]
    lines = [f"\n## {row['scheme']}: {kernels:.0f} us of kernels per decode step, {wall:.0f} us wall"
             f" ({max(wall - kernels, 0.0):.0f} us with no kernel running)"]  # fmt: skip
    lines += [f"  {cat:18s} {t:9.1f} us" for cat, t in row["by_category_us"].items()]
    lines += [f"    {k['us_per_step']:9.1f} us  [{k['category']}] {k['name'][:110]}"
              for k in row["top_kernels_us"]]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-weights", default="qwen2.5-7b")
    p.add_argument("--quant", default="bf16,fp8,int8")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--compile", default="reduce-overhead", help="none or a torch.compile mode")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default="profile_decode_step.json")
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error("--output-len must be at least 2 (decode = a generate minus its prefill)")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model_dir(args.random_weights, Path(tmp) / "model")
        for scheme in args.quant.split(","):
            rows.append(profile_scheme(model_dir, scheme, args))
            print(report(rows[-1]), flush=True)
            doc = {"config": vars(args), "torch": torch.__version__, "rows": rows}
            atomic_write_text(Path(args.out), json.dumps(doc, indent=1))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
