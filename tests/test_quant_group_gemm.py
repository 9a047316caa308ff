"""The Triton GEMM of the `int8_g*` schemes (`flashrl.quant.kernels.group_gemm`) on CPU under the
Triton interpreter, against a float64 reference of its formula and the torch reference
`flashrl.quant.gemm.int8_group`; its routing in `flashrl.quant.dispatch.GEMMS`; its PTX.

Tolerances (per element, u = 2^-24, G = ceil(K/g) groups, A = |s_w| sum_g |s_x[g]| sum_k |Xq Wq|
+ |bias|, the magnitude of the terms):
- fp32 output vs float64: each group's int32 dot is exact, ``dot * s_x`` rounds once, the G-term
  sum rounds G - 1 times, then ``* s_w`` and ``+ bias``: |err| <= (G + 2) u A (recursive summation).
- vs the reference: it rounds ``s_x * q`` and sums K products in fp32, |err| <= (K + 3) u A, so
  the two differ by at most (K + G + 5) u A.
- Measured (interpreter, groups 64 / 128, K up to 2048): at most 1.5 u A per element; max-abs
  error 1.8e-7 of max |Y| against float64, 5.6e-7 against the reference.
- bf16 / fp16 output: the kernel's fp32 result rounded to nearest even, bit for bit
  (``y32.to(dtype)``); against the reference one ulp of the output more.

GPU session: ``python -m pytest tests/test_quant_group_gemm.py -m gpu -v`` (TRITON_INTERPRET unset).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from flashrl.errors import InputError
from flashrl.quant import dispatch, gemm, kernels, primitives
from flashrl.quant.gemm import GemmArgs
from flashrl.quant.kernels import launch
from flashrl.quant.schemes import get_scheme

U = 2.0**-24
OUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
"""Largest ulp of the output dtype relative to the value (normal range)."""
SHAPES = [(1, 64, 16), (1, 200, 40), (3, 130, 70), (17, 300, 33), (40, 257, 100)]  # (M, K, N)
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def operands(m: int, k: int, n: int, group: int, bias: bool, gen: torch.Generator, device="cpu"):
    """Codes and scales as the `int8_g*` scheme makes them (outlier columns so groups differ)."""
    x = torch.randn(m, k, generator=gen)
    x[:, :: max(1, k // 5)] *= 30.0
    w = torch.randn(n, k, generator=gen) * 0.05
    xq, sx = primitives.quantize_per_group(x, torch.int8, group)
    wq, sw = primitives.quantize_per_row(w, torch.int8)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    move = [t.to(device) if t is not None else None for t in (xq, sx, wq, sw, b)]
    return tuple(move)


def reference64(xq, sx, wq, sw, b, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Y, A) in float64: the formula group by group; A bounds the terms. The dots are float64
    matmuls of the codes, exact (every partial sum is an integer below g * 127^2 << 2^53)."""
    k = xq.shape[1]
    y = torch.zeros(xq.shape[0], wq.shape[0], dtype=torch.float64)
    mag = torch.zeros_like(y)
    for g, start in enumerate(range(0, k, group)):
        xg, wg = xq[:, start : start + group].double(), wq[:, start : start + group].double()
        s = sx[:, g : g + 1].double()
        y += (xg @ wg.t()) * s
        mag += (xg.abs() @ wg.abs().t()) * s.abs()
    sw64 = sw.double().reshape(1, -1)
    y, mag = y * sw64, mag * sw64.abs()
    if b is not None:
        y, mag = y + b.double(), mag + b.double().abs()
    return y, mag


def assert_within(y: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> float:
    """|y - want| <= bound everywhere; returns the largest error relative to max |want|."""
    err = (y.double().cpu() - want).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"
    )
    return (err.max() / want.abs().max().clamp_min(1e-30)).item()


def check_against_references(xq, sx, wq, sw, b, group: int, out_dtype: torch.dtype) -> None:
    """The kernel vs float64 (fp32 output), its rounding, and vs `gemm.int8_group`."""
    k = xq.shape[1]
    groups = -(-k // group)
    y32 = launch.int8_group_gemm(xq, sx, wq, sw, group, torch.float32, b)
    y = launch.int8_group_gemm(xq, sx, wq, sw, group, out_dtype, b)
    assert y.dtype == out_dtype and y.shape == (xq.shape[0], wq.shape[0])
    want, mag = reference64(
        xq.cpu(), sx.cpu(), wq.cpu(), sw.cpu(), None if b is None else b.cpu(), group
    )
    assert_within(y32, want, (groups + 2) * U * mag, "fp32 output vs float64")
    assert torch.equal(y, y32.to(out_dtype)), "not the fp32 result rounded to nearest even"
    scheme = get_scheme(f"int8_g{group}")
    ref = gemm.int8_group(GemmArgs(xq, sx, wq, sw, scheme, out_dtype, b))
    bound = (k + groups + 5) * U * mag + OUT_ULP[out_dtype] * want.abs().clamp_min(1e-30)
    assert_within(y, ref.double().cpu(), bound, "vs gemm.int8_group")


# ------------------------------------------------------------------------------------------------
# interpreter
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("group", [64, 128])
def test_kernel_matches_fp64_and_reference(group, m, k, n, bias, out_dtype, gen, interpret):
    """K not a multiple of the group (the last group partial), M = 1, 3, 17, 40, N not a multiple
    of BLOCK_N, bias or none, every output dtype."""
    xq, sx, wq, sw, b = operands(m, k, n, group, bias, gen)
    check_against_references(xq, sx, wq, sw, b, group, out_dtype)


def test_error_is_fp32_rounding_not_worse(gen, interpret):
    """The measured error is of the order of fp32 rounding (max-abs relative to max |Y| below
    1e-6), and an fp32 cast of the per-group sum in bf16 would not pass (the bound can fail)."""
    xq, sx, wq, sw, b = operands(17, 1000, 48, 64, True, gen)
    y = launch.int8_group_gemm(xq, sx, wq, sw, 64, torch.float32, b)
    want, mag = reference64(xq, sx, wq, sw, b, 64)
    assert assert_within(y, want, 18 * U * mag, "fp32 vs float64") < 1e-6
    coarse = y.to(torch.bfloat16).double()
    assert ((coarse - want).abs() > 18 * U * mag).any(), "the bound must tell bf16 rounding apart"


def test_strided_operands_and_odd_group(gen, interpret):
    """Non-contiguous codes and scales, a group that is not a power of two (BLOCK_K padded and
    masked inside the tile), and a single per-tensor weight scale."""
    x = torch.randn(140, 5, generator=gen).t()  # [5, 140], column-major
    xq, sx = primitives.quantize_per_group(x, torch.int8, 48)
    w = torch.randn(24, 140, generator=gen) * 0.05
    wq, sw = primitives.quantize_per_row(w, torch.int8)
    xq_t = xq.t().contiguous().t()
    assert not xq_t.is_contiguous()
    y = launch.int8_group_gemm(xq_t, sx.t().contiguous().t(), wq, sw, 48, torch.float32)
    want, mag = reference64(xq, sx, wq, sw, None, 48)
    assert_within(y, want, 5 * U * mag, "strided, group 48")
    one = sw.max().reshape(())
    y1 = launch.int8_group_gemm(xq, sx, wq, one, 48, torch.float32)
    want1, mag1 = reference64(xq, sx, wq, one.expand(24, 1), None, 48)
    assert_within(y1, want1, 5 * U * mag1, "one weight scale")


def test_empty_and_bad_inputs(interpret):
    xq = torch.zeros(0, 64, dtype=torch.int8)
    y = launch.int8_group_gemm(
        xq,
        torch.ones(0, 1),
        torch.zeros(8, 64, dtype=torch.int8),
        torch.ones(8, 1),
        64,
        torch.bfloat16,
    )
    assert y.shape == (0, 8) and y.dtype == torch.bfloat16
    xq, wq = torch.zeros(2, 130, dtype=torch.int8), torch.zeros(8, 130, dtype=torch.int8)
    good = (xq, torch.ones(2, 3), wq, torch.ones(8, 1), 64)
    with pytest.raises(
        InputError, match=r"activation scales must be \[M, ceil\(K / group\)\] = \[2, 3\]"
    ):
        launch.int8_group_gemm(xq, torch.ones(2, 2), wq, torch.ones(8, 1), 64, torch.float32)
    with pytest.raises(InputError, match="weight codes must be"):
        launch.int8_group_gemm(
            xq, torch.ones(2, 3), wq[:, :128], torch.ones(8, 1), 64, torch.float32
        )
    with pytest.raises(InputError, match="int8 codes"):
        launch.int8_group_gemm(xq.float(), *good[1:], torch.float32)
    with pytest.raises(InputError, match="out_dtype torch.int32 is not one of"):
        launch.int8_group_gemm(*good, torch.int32)
    with pytest.raises(InputError, match="bias must have 8 elements"):
        launch.int8_group_gemm(*good, torch.float32, torch.ones(7))
    with pytest.raises(InputError, match="one per output row"):
        launch.int8_group_gemm(xq, torch.ones(2, 3), wq, torch.ones(4), 64, torch.float32)


# ------------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------------


def fake_cuda_codes() -> SimpleNamespace:
    """What `kernels.use_triton` reads of a tensor, for a CUDA one (no GPU here)."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda"))


def test_dispatch_picks_the_triton_gemm_for_cuda(monkeypatch):
    """CUDA: `int8_group_cuda`, which runs the Triton GEMM in modes auto (triton installed) and
    triton, the reference in mode torch or without triton; the CPU keeps the reference."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert dispatch.GEMMS["int8_group", "cuda"] is gemm.int8_group_cuda
    assert dispatch.GEMMS["int8_group", "cpu"] is gemm.int8_group
    scheme, scale = get_scheme("int8_g64"), torch.ones(2, 3)
    assert dispatch.gemm_kind(scheme, scale, torch.ones(8, 1)) == "int8_group"
    cuda = fake_cuda_codes()
    assert gemm.int8_group_impl(cuda) is gemm.int8_group_triton
    with kernels.mode_scope("triton"):
        assert gemm.int8_group_impl(cuda) is gemm.int8_group_triton
    with kernels.mode_scope("torch"):
        assert gemm.int8_group_impl(cuda) is gemm.int8_group
    assert gemm.int8_group_impl(torch.zeros(2, 64, dtype=torch.int8)) is gemm.int8_group
    monkeypatch.setattr(kernels, "_triton_found", False)
    assert gemm.int8_group_impl(cuda) is gemm.int8_group


def test_cuda_entry_runs_the_kernel(monkeypatch, gen, interpret):
    """`int8_group_cuda` launches `launch.int8_group_gemm` when Triton is chosen (forced here on
    CPU tensors under the interpreter) and the reference when it is not."""
    calls = []
    real = launch.int8_group_gemm
    monkeypatch.setattr(
        launch, "int8_group_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    xq, sx, wq, sw, b = operands(3, 200, 40, 64, True, gen)
    args = GemmArgs(xq, sx, wq, sw, get_scheme("int8_g64"), torch.bfloat16, b)
    with kernels.mode_scope("triton"):
        y = dispatch.GEMMS["int8_group", "cuda"](args)
    assert calls == [1]
    assert torch.equal(y, real(xq, sx, wq, sw, 64, torch.bfloat16, b))
    with kernels.mode_scope("torch"):
        assert torch.equal(dispatch.GEMMS["int8_group", "cuda"](args), gemm.int8_group(args))
    assert calls == [1]


# ------------------------------------------------------------------------------------------------
# GPU code generation, checked on CPU
# ------------------------------------------------------------------------------------------------


def test_ptx_multiplies_int8_on_tensor_cores():
    """The kernel compiles for sm_90 and sm_80 (Triton's bundled toolchain, no GPU) and its dot
    is an integer MMA (s8 x s8 -> s32), never a float one."""
    import triton
    from triton.backends import backends

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip(
            f"compiling without a GPU needs triton >= 3.4 (installed: {triton.__version__})"
        )
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    from test_quant_kernels import GROUP_GEMM_PTX_CASES, compile_ptx

    fn = kernels._load(interpret=False, source="group_gemm").int8_group_gemm_kernel
    for pointers, constexprs, arches in GROUP_GEMM_PTX_CASES:
        for arch in arches:
            ptx = compile_ptx(fn, pointers, constexprs, arch)
            mmas = set(re.findall(r"\b(?:wgmma\.mma_async|mma)\.[a-z0-9._]+", ptx))
            assert mmas and all(".s32.s8.s8" in op for op in mmas), (arch, constexprs, mmas)


@pytest.mark.parametrize(
    "tiles",
    [(16, 16, 4, None), (32, 16, 2, 2), (16, 64, 8, 3), (64, 32, 4, None)],
)
def test_any_tiles_give_the_same_bits(tiles, gen, interpret):
    """`GroupTiles` changes the launch only: each output element sums its groups in the same order
    whatever the tile, so every choice equals the default bit for bit (shapes with several programs
    along M and N, and partial tiles)."""
    for m, k, n in [(3, 200, 48), (40, 130, 70)]:
        xq, sx, wq, sw, b = operands(m, k, n, 64, True, gen)
        want = launch.int8_group_gemm(xq, sx, wq, sw, 64, torch.bfloat16, b)
        got = launch.int8_group_gemm(
            xq, sx, wq, sw, 64, torch.bfloat16, b, tiles=launch.GroupTiles(*tiles)
        )
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, k, n)


@pytest.mark.parametrize(
    "bad,field",
    [
        ((8, 16), "block_m"),
        ((16, 48), "block_n"),
        ((16, 16, 3), "num_warps"),
        ((16, 16, 4, 0), "num_stages"),
    ],
)
def test_group_tiles_refuse_what_the_kernel_cannot_launch(bad, field):
    with pytest.raises(InputError, match=f"GroupTiles.{field}"):
        launch.GroupTiles(*bad)


def test_bench_group_gemm_runs_variants_and_checks_bits(tmp_path, monkeypatch):
    """benchmarks/bench_group_gemm.py on CPU (interpreter): one row per layer and variant, every
    variant's output equal to the default's, JSON written; a malformed variant is refused by name."""
    import json

    from benchmark_scripts import load_benchmark

    bench = load_benchmark("bench_group_gemm")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "tiles.json"
    argv = ["--device", "cpu", "--shapes", "a:48x200,b:20x64", "--m", "3", "--repeat", "1"]
    rc = bench.main([*argv, "--variants", "default,16x16w4,32x16w2s2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and len(rows) == 6 and all(r["same_bits"] for r in rows)
    assert [r["programs"] for r in rows[:3]] == [2, 3, 3]
    with pytest.raises(SystemExit, match="'64x32'"):
        bench.main([*argv, "--variants", "64x32", "--out", str(out)])
    with pytest.raises(SystemExit, match="block_n"):
        bench.main([*argv, "--variants", "16x24w4", "--out", str(out)])


# ------------------------------------------------------------------------------------------------
# GPU (compiled kernel on CUDA)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", [64, 128])
def test_gpu_kernel_matches_fp64(group, gen, monkeypatch):
    """Compiled on CUDA: decode and prefill shapes against float64 and the reference, every output
    dtype; and `scaled_linear` on CUDA goes through the kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for m, k, n in [(1, 4096, 4096), (17, 4096, 1000), (256, 3000, 1536), (5, 200, 40)]:
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            ops = operands(m, k, n, group, out_dtype != torch.float32, gen, "cuda")
            check_against_references(*ops, group, out_dtype)
    calls = []
    real = launch.int8_group_gemm
    monkeypatch.setattr(
        launch, "int8_group_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    scheme = get_scheme(f"int8_g{group}")
    wq, sw = dispatch.quantize_weight(torch.randn(64, 256, device="cuda"), scheme)
    dispatch.scaled_linear(torch.randn(3, 256, device="cuda", dtype=torch.bfloat16), wq, sw, scheme)
    assert calls == [1]
