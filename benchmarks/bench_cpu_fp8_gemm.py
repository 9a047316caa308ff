"""The CPU fp8 GEMM: torch's `_scaled_mm` (rowwise scales) against flashrl's fp32 matmul of the
decoded codes (`flashrl.quant.gemm.fp8_rowwise_cpu`), in one run, paired rounds.

    python benchmarks/bench_cpu_fp8_gemm.py --threads 1
    python benchmarks/bench_cpu_fp8_gemm.py --threads 2 --engine-schemes fp8_channel,fp8 --tokens 32

1. GEMMs at SmolLM2-135M's shapes (q/k/v fused, o, gate/up fused, down) for a decode batch (M=16)
   and a prefill (M=640): median ms of `_scaled_mm`, of the decoded-fp32 path, of the exact int8
   CPU path and of a bf16 `torch.mm`, each round timing every op in turn.
2. Decode on the real model (`builtin:smollm2-135m`, batch 16): each fp8 scheme of
   `--engine-schemes` twice, with the CPU fp8 GEMM routed to `_scaled_mm` (as before) and to the
   fp32 path, plus int8; each round generates the same batch with every engine in turn.

Table + JSON (default results/cpu_fp8_gemm.json). Both paths give the same products (every product
of two e4m3 values is exact in fp32) in another summation order.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from _common import device_name, format_table, write_json
from flashrl.core.config import RolloutConfig
from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.quant import dispatch, gemm
from flashrl.quant.dispatch import quantize_activation, quantize_weight
from flashrl.quant.schemes import get_scheme
from flashrl.rl.presets import resolve_model
from mismatch import prompts_for

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
"""(K, N) of SmolLM2-135M's fused linear layers."""


@contextmanager
def scaled_mm_on_cpu(enabled: bool):
    """Route the CPU fp8 GEMM kinds to torch's `_scaled_mm` (the CUDA functions, on CPU tensors)."""
    saved = {k: dispatch.GEMMS[k, "cpu"] for k in ("fp8_tensorwise", "fp8_rowwise")}
    if enabled:
        dispatch.GEMMS["fp8_tensorwise", "cpu"] = gemm.fp8_tensorwise_cuda
        dispatch.GEMMS["fp8_rowwise", "cpu"] = gemm.fp8_rowwise_cuda
    try:
        yield
    finally:
        for k, fn in saved.items():
            dispatch.GEMMS[k, "cpu"] = fn


def gemm_ops(m: int, k: int, n: int, gen: torch.Generator) -> dict:
    """The four ops of one shape, as zero-argument callables."""
    fp8, int8 = get_scheme("fp8_channel"), get_scheme("int8")
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    f8 = gemm.GemmArgs(*quantize_activation(x, fp8), *quantize_weight(w, fp8), fp8, torch.bfloat16)
    i8 = gemm.GemmArgs(*quantize_activation(x, int8), *quantize_weight(w, int8), int8, torch.bfloat16)  # fmt: skip
    xb, wb = x.bfloat16(), w.bfloat16()
    return {
        "scaled_mm": lambda: gemm.fp8_rowwise_cuda(f8),
        "fp32 decoded": lambda: gemm.fp8_rowwise_cpu(f8),
        "int8 exact": lambda: gemm.int8_rowwise_cpu(i8),
        "bf16 mm": lambda: torch.mm(xb, wb.t()),
    }


def gemm_rows(rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in (16, 640):
        for name, (k, n) in SHAPES.items():
            ops = gemm_ops(m, k, n, gen)
            times: dict[str, list[float]] = {op: [] for op in ops}
            for fn in ops.values():
                fn()  # warm-up
            for _ in range(rounds):
                for op, fn in ops.items():
                    start = time.perf_counter()
                    for _ in range(5):
                        fn()
                    times[op].append((time.perf_counter() - start) / 5 * 1e3)
            med = {op: statistics.median(t) for op, t in times.items()}
            rows.append({"M": m, "layer": name, "K": k, "N": n, **{f"{op} ms": v for op, v in med.items()},
                         "scaled_mm / fp32": med["scaled_mm"] / med["fp32 decoded"]})  # fmt: skip
    return rows


def engine_rows(schemes: list[str], batch: int, tokens: int, rounds: int) -> list[dict]:
    model_dir = resolve_model("builtin:smollm2-135m")
    variants = [("int8", False)] + [(s, via) for s in schemes for via in (True, False)]
    engine_config = EngineConfig(
        dtype="bf16", max_len=128 + tokens, max_batch=batch, progress=False
    )
    engines = {v: Engine(model_dir, RolloutConfig(quant=v[0]), engine_config) for v in variants}
    prompts = (prompts_for(engines[variants[0]], 16) * batch)[:batch]
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
    speeds: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    for v, engine in engines.items():  # warm-up
        with scaled_mm_on_cpu(v[1]):
            engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, seed=1))
    for _ in range(rounds):
        for v, engine in engines.items():
            with scaled_mm_on_cpu(v[1]):
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                elapsed = time.perf_counter() - start
            speeds[v].append(sum(len(o.response_ids) for o in outs) / elapsed)
    base = statistics.median(speeds[variants[0]])
    return [
        {"scheme": s, "cpu fp8 gemm": "_scaled_mm" if via else ("fp32 decoded" if s != "int8" else "-"),
         "tok/s": statistics.median(speeds[s, via]),
         "vs int8": statistics.median(speeds[s, via]) / base,
         "rounds": speeds[s, via]}
        for s, via in variants
    ]  # fmt: skip


def table(rows: list[dict], digits: int) -> str:
    shown = [
        {k: f"{v:.{digits}f}" if isinstance(v, float) else str(v) for k, v in r.items()}
        for r in rows
    ]
    return format_table(shown, list(shown[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine-schemes", default="fp8_channel,fp8,fp8_block")
    parser.add_argument("--engine-rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="results/cpu_fp8_gemm.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gemms = gemm_rows(args.rounds)
    print(table(gemms, 3))
    schemes = [s for s in args.engine_schemes.split(",") if s]
    decode = engine_rows(schemes, args.batch, args.tokens, args.engine_rounds) if schemes else []
    if decode:
        print(table([{k: v for k, v in r.items() if k != "rounds"} for r in decode], 2))
    write_json(args.out, {"device": device_name(torch.device("cpu")),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "gemm": gemms, "decode": decode})  # fmt: skip


if __name__ == "__main__":
    main()
