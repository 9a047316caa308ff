"""Time the `int8_g*` Triton GEMM per launch shape (`launch.GroupTiles`) on a decode step's linear
layers, against bf16 ``x @ w.T`` and int8's integer GEMM (`gemm.int8_mm_cuda`, no epilogue).

Why: on an H200 at 7B dimensions, batch 64, the `int8_g64` decode step with CUDA graphs took 9.96 ms
against int8's 6.38 and bf16's 6.60 (benchmarks/RESULTS.md, fourth GPU session). The default tiles
(64 x 64 at M = 64) give N = 3584 layers 56 programs on 132 SMs; this script times alternatives per
shape so that `launch.group_gemm_tiles` can be chosen from numbers.

Every variant's output must equal the default tiles' bit for bit (each element sums its groups in
the same order whatever the tile): the ``same_bits`` column, and the script exits 1 if one differs.
On CPU the kernel runs in the Triton interpreter: a check of the script and of the bit equality on
small shapes, not a timing (the ms columns are then interpreter times).

    python benchmarks/bench_group_gemm.py --device cuda [--m 64] [--group 64] [--out FILE]
    python benchmarks/bench_group_gemm.py --device cpu --shapes t:48x200 --m 3 --variants 16x16w4
Variants: ``{BLOCK_M}x{BLOCK_N}w{warps}[s{stages}]``, or ``default`` (`group_gemm_tiles`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from _common import device_name, format_table, time_fn, write_json
from flashrl.quant import gemm, primitives
from flashrl.quant.kernels import launch, triton_available

SHAPES_7B = "qkv:4608x3584,o:3584x3584,gate_up:37888x3584,down:3584x18944"
"""Qwen2.5-7B's linear layers as name:NxK (fused q/k/v and gate/up, as the engine runs them)."""
VARIANTS = "default,64x32w4,64x16w4,32x32w4,64x32w4s4,64x64w4s4,64x32w2s3,64x64w8s3"
VARIANT = re.compile(r"^(\d+)x(\d+)w(\d+)(?:s(\d+))?$")


def parse_variant(text: str) -> launch.GroupTiles | None:
    """``default`` -> None (the rule); ``64x32w4s3`` -> GroupTiles(64, 32, 4, 3)."""
    if text == "default":
        return None
    match = VARIANT.match(text)
    if not match:
        raise SystemExit(
            f"--variants: {text!r} is not 'default' or BMxBNwW[sS] (for example 64x32w4s3)"
        )
    bm, bn, warps, stages = match.groups()
    try:
        return launch.GroupTiles(int(bm), int(bn), int(warps), int(stages) if stages else None)
    except ValueError as err:  # InputError names the field and what is allowed
        raise SystemExit(f"--variants {text!r}: {err}") from err


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """``name:NxK,...`` -> [(name, N, K)]."""
    shapes = []
    for item in text.split(","):
        name, _, dims = item.partition(":")
        match = re.match(r"^(\d+)x(\d+)$", dims)
        if not name or not match:
            raise SystemExit(f"--shapes: {item!r} is not name:NxK (for example o:3584x3584)")
        shapes.append((name, int(match.group(1)), int(match.group(2))))
    return shapes


def timer(device: torch.device, repeat: int):
    """Median milliseconds of a call: Triton's do_bench on CUDA, wall time elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median")
    return lambda fn: time_fn(fn, device, warmup=1, repeat=repeat) * 1e3


def bench_shape(name, n, k, m, group, variants, device, ms_of) -> list[dict]:
    """One row per variant, plus the bf16 and int8 baselines' times on every row."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
    xq, sx = primitives.quantize_per_group(x, torch.int8, group)
    wq, sw = primitives.quantize_per_row(w, torch.int8)
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16_ms = ms_of(lambda: xb @ wb.t())
    int8_ms = ms_of(lambda: gemm.int8_mm_cuda(xq, wq)) if device.type == "cuda" else float("nan")
    base = launch.int8_group_gemm(xq, sx, wq, sw, group, torch.bfloat16)
    rows = []
    for text, tiles in variants:
        run = lambda t=tiles: launch.int8_group_gemm(xq, sx, wq, sw, group, torch.bfloat16, tiles=t)  # noqa: E731
        y = run()
        ms = ms_of(run)
        shape = tiles or launch.group_gemm_tiles(m, n)
        rows.append(
            dict(
                layer=name,
                NxK=f"{n}x{k}",
                variant=text,
                programs=launch.cdiv(m, shape.block_m) * launch.cdiv(n, shape.block_n),
                ms=ms,
                weight_GBps=n * k / ms / 1e6,
                vs_int8=int8_ms / ms,
                vs_bf16=bf16_ms / ms,
                same_bits=torch.equal(y.view(torch.int16), base.view(torch.int16)),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=SHAPES_7B, help="name:NxK,... (default: Qwen2.5-7B)")
    parser.add_argument("--m", type=int, default=64, help="rows (decode batch)")
    parser.add_argument("--group", type=int, default=64, help="activation group size")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--repeat", type=int, default=5, help="CPU only: timed calls per variant")
    parser.add_argument("--out", default="benchmarks/results/group_gemm_tiles.json")
    args = parser.parse_args(argv)
    if not triton_available():
        raise SystemExit("triton is not installed: the int8_g* GEMM kernel needs it")
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernel loader reads it per call
    variants = [(v.strip(), parse_variant(v.strip())) for v in args.variants.split(",")]
    ms_of = timer(device, args.repeat)
    rows = []
    for name, n, k in parse_shapes(args.shapes):
        rows += bench_shape(name, n, k, args.m, args.group, variants, device, ms_of)
        print(format_table(rows[-len(variants) :], list(rows[-1])), flush=True)
    print(f"device: {device_name(device)}; M = {args.m}, group {args.group}; bf16 output")
    write_json(
        args.out,
        dict(
            device=device_name(device),
            torch=torch.__version__,
            m=args.m,
            group=args.group,
            rows=rows,
        ),
    )
    differ = [f"{r['layer']} {r['variant']}" for r in rows if not r["same_bits"]]
    if differ:
        print(f"outputs differ from the default tiles' (a kernel bug): {', '.join(differ)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
