"""Scaled GEMMs against exact integer math and float64 dequantize-then-matmul references.

Tolerances: the int8 accumulator is exact (torch.equal); the int8 fp32 epilogue matches the same
epilogue written out (torch.equal) and the float64 reference to 1e-6 relative. fp8 `_scaled_mm`
with fp32 output matches the float64 reference to 1e-5 relative (max-abs over max-abs; measured
about 1e-7); bf16 output adds bf16 rounding (2^-8 relative), so 8e-3.
"""

from __future__ import annotations

import pytest
import torch

from flashrl.quant.dispatch import (
    prequantized_linear,
    quantize_activation,
    quantize_weight,
    scaled_linear,
)
from flashrl.quant.gemm import int8_mm_cpu, int8_mm_cuda, pad_rows
from flashrl.quant.primitives import dequantize_per_block, dequantize_per_group, quantize_per_row
from flashrl.quant.schemes import get_scheme

SHAPES = [(1, 16, 8), (3, 13, 7), (15, 200, 96), (17, 128, 256), (40, 300, 130)]  # (M, K, N)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (
        (y.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)
    ).item()


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_mm_is_exact_integer_math(m, k, n, gen):
    a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    exact = a.long() @ b.long().t()
    assert torch.equal(int8_mm_cpu(a, b).long(), exact)
    assert torch.equal(int8_mm_cuda(a, b).long(), exact), (
        "zero-row padding for CUDA's M > 16 rule (torch._int_mm runs on the CPU too)"
    )


def test_pad_rows():
    x = torch.ones(3, 4, dtype=torch.int8)
    padded = pad_rows(x, 17)
    assert padded.shape == (17, 4) and (padded[3:] == 0).all() and torch.equal(padded[:3], x)
    assert pad_rows(x, 2) is x


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_exact_epilogue_and_fp64(m, k, n, bias, gen):
    scheme = get_scheme("int8")
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    wq, sw = quantize_weight(w, scheme)
    y = scaled_linear(x, wq, sw, scheme, b, torch.float32)
    xq, sx = quantize_per_row(x, torch.int8)
    acc = xq.long() @ wq.long().t()
    same_epilogue = acc.to(torch.int32).float() * sx * sw.reshape(1, -1)
    if b is not None:
        same_epilogue = same_epilogue + b
    assert torch.equal(y, same_epilogue)
    ref64 = acc.double() * sx.double() * sw.double().reshape(1, -1) + (
        b.double() if b is not None else 0
    )
    assert rel_err(y, ref64) < 1e-6


@pytest.mark.parametrize("name", ["fp8", "fp8_channel"])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("out_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_fp8_scaled_mm_against_fp64_dequant(name, m, k, n, out_dtype, tol, gen):
    scheme = get_scheme(name)
    x = torch.randn(m, k, generator=gen) * 2
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, sw = quantize_weight(w, scheme)
    xq, sx = quantize_activation(x, scheme)
    ref = (xq.double() * sx.double()) @ (
        wq.double() * sw.double().reshape(-1, 1) if sw.dim() else wq.double() * sw.double()
    ).t()
    y = scaled_linear(x, wq, sw, scheme, None, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert rel_err(y, ref) < tol


@pytest.mark.parametrize("name", ["fp8", "fp8_channel"])
@pytest.mark.parametrize("out_dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_fp8_cpu_gemm_multiplies_the_decoded_codes_in_fp32(name, out_dtype, tol, monkeypatch, gen):
    """The CPU fp8 GEMM multiplies the fp8 codes in fp32 (every product of two e4m3 values is exact
    there): within fp32 summation rounding of torch's own `_scaled_mm` (the CUDA function, run on
    CPU tensors) and of the float64 reference, and it never calls `_scaled_mm` itself."""
    import flashrl.quant.gemm as gemm

    scheme = get_scheme(name)
    x, w = torch.randn(9, 256, generator=gen), torch.randn(48, 256, generator=gen) * 0.05
    wq, sw = quantize_weight(w, scheme)
    xq, sx = quantize_activation(x, scheme)
    args = gemm.GemmArgs(xq, sx, wq, sw, scheme, out_dtype)
    torch_kernel = gemm.fp8_rowwise_cuda(args)  # torch's CPU `_scaled_mm`, rowwise scales
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("_scaled_mm called"))
    y = scaled_linear(x, wq, sw, scheme, None, out_dtype)
    ref = (xq.double() * sx.double()) @ (wq.double() * sw.double().reshape(-1, 1)).t()
    assert y.dtype == out_dtype and rel_err(y, ref) < tol and rel_err(y, torch_kernel) < tol
    if scheme.activation_granularity == "token":  # MoE experts' path: the same ops, same bits
        assert torch.equal(prequantized_linear(xq, sx, wq, sw, scheme, out_dtype), y)


def test_fp8_codes_decode_to_fp32_bit_for_bit():
    """The CPU lookup gives what torch's cast gives for all 256 codes (NaN codes too), in any
    layout."""
    from flashrl.quant.encode import fp8_to_fp32

    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    for view in (q, q.t(), q[3:9, 2:7]):
        bits = fp8_to_fp32(view).view(torch.int32)
        assert torch.equal(bits, view.to(torch.float32).view(torch.int32))
    assert int(fp8_to_fp32(q).isnan().sum()) == 2


def test_fp8_tensor_with_per_row_weight_scale_equals_per_shard(gen):
    """A fused per-tensor layer passes one scale per row; equal row scales give the tensorwise result."""
    scheme = get_scheme("fp8")
    x, w = torch.randn(5, 64, generator=gen), torch.randn(32, 64, generator=gen)
    wq, sw = quantize_weight(w, scheme)
    y_tensor = scaled_linear(x, wq, sw, scheme, None, torch.float32)
    y_rows = scaled_linear(x, wq, sw.expand(32).contiguous(), scheme, None, torch.float32)
    assert rel_err(y_rows, y_tensor) < 1e-6


@pytest.mark.parametrize("m,k,n", SHAPES + [(4, 384, 256)])
def test_fp8_block_against_groupwise_fp64_formula(m, k, n, gen):
    """Y[m,n] = sum_g s_x[m,g] s_w[n//128,g] (Xq_g . Wq_g), written as an explicit loop over groups."""
    scheme = get_scheme("fp8_block")
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, sw = quantize_weight(w, scheme)
    xq, sx = quantize_activation(x, scheme)
    ref = torch.zeros(m, n, dtype=torch.float64)
    for g in range((k + 127) // 128):
        cols = slice(g * 128, (g + 1) * 128)
        dot = xq[:, cols].double() @ wq[:, cols].double().t()
        w_scale = sw[:, g].double().repeat_interleave(128)[:n]
        ref += dot * sx[:, g : g + 1].double() * w_scale.reshape(1, -1)
    y = scaled_linear(x, wq, sw, scheme, None, torch.float32)
    assert rel_err(y, ref) < 1e-5
    y_deq = (
        dequantize_per_group(xq, sx, dtype=torch.float64)
        @ dequantize_per_block(wq, sw, dtype=torch.float64).t()
    )
    assert rel_err(ref, y_deq) < 1e-12


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("m,k,n", SHAPES + [(4, 576, 192)])
def test_int8_group_against_groupwise_fp64_formula(m, k, n, group, gen):
    """int8_g*: Y[m,n] = sum_g s_x[m,g] (Xq_g . Wq_g) s_w[n], written as an explicit loop over groups
    in float64 (576 columns: a partial last group of 128)."""
    scheme = get_scheme(f"int8_g{group}")
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 40  # an outlier channel: groups keep it out of the other groups' scales
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, sw = quantize_weight(w, scheme)
    assert torch.equal(wq, quantize_weight(w, get_scheme("int8"))[0])  # int8's weights
    xq, sx = quantize_activation(x, scheme)
    assert sx.shape == (m, -(-k // group))
    ref = torch.zeros(m, n, dtype=torch.float64)
    for g in range(sx.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        dot = xq[:, cols].double() @ wq[:, cols].double().t()
        ref += dot * sx[:, g : g + 1].double() * sw.double().reshape(1, -1)
    bias = torch.randn(n, generator=gen)
    y = scaled_linear(x, wq, sw, scheme, bias, torch.float32)
    assert rel_err(y, ref + bias.double()) < 1e-6
    per_token = scaled_linear(x, wq, sw, get_scheme("int8"), None, torch.float32)
    exact = x.double() @ w.double().t()
    if k > group:  # the point of groups (one group is per-token int8 itself)
        assert rel_err(y - bias, exact) < rel_err(per_token, exact)
    else:
        assert rel_err(y - bias, per_token) < 1e-6


@pytest.mark.parametrize(
    "name,tol",
    [
        ("int8", 0.03),
        ("fp8", 0.1),
        ("fp8_channel", 0.1),
        ("fp8_block", 0.1),
        ("int8_g128", 0.03),
        ("int8_g64", 0.03),
    ],
)
def test_end_to_end_error_vs_unquantized(name, tol, gen):
    """Against the float64 product of the unquantized tensors (the quantization error itself)."""
    scheme = get_scheme(name)
    x = torch.randn(2, 7, 256, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(192, 256, generator=gen) * 0.02).to(torch.bfloat16)
    b = torch.randn(192, generator=gen).to(torch.bfloat16)
    wq, sw = quantize_weight(w, scheme)
    y = scaled_linear(x, wq, sw, scheme, b)
    assert y.shape == (2, 7, 192) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().t() + b.double()
    assert rel_err(y, ref) < tol


@pytest.mark.parametrize("k", [8, 1024, 1025, 3000])
def test_cpu_int8_mm_fp32_chunks_are_exact_at_the_extremes(k, gen):
    """The CPU path (fp32 matmuls over 1024-column chunks) equals int64 math and torch._int_mm
    bit for bit, also where one fp32 matmul over all of K could not be exact (|sum| > 2^24)."""
    from flashrl.quant.gemm import int8_mm_exact_fp32

    worst = torch.full((3, k), -128, dtype=torch.int8)
    rand_a = torch.randint(-128, 128, (20, k), generator=gen, dtype=torch.int8)
    rand_b = torch.randint(-128, 128, (24, k), generator=gen, dtype=torch.int8)
    for a, b in ((worst, worst), (rand_a, rand_b), (rand_a, worst)):
        exact = a.long() @ b.long().t()
        got = int8_mm_exact_fp32(a, b)
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), exact)
        assert torch.equal(int8_mm_cpu(a, b), got)  # the CPU default path
        if a.shape[0] > 16:
            assert torch.equal(torch._int_mm(a, b.t()), got)
    if k == 3000:  # the case chunking exists for: one fp32 matmul over K would round
        assert (worst.long() @ worst.long().t()).max() > 2**24
