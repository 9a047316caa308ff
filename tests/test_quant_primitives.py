"""Quantize / dequantize primitives against float64 and plain per-block references.

Tolerances (stated, not tuned): int8 round-to-nearest gives |x - q*s| <= s/2 per element; fp8 e4m3
has 3 mantissa bits, so |x - q*s| <= 2^-4 |x| in the normal range and <= 2^-10 s below it (the
subnormal spacing is 2^-9 s). A factor 1 + 1e-6 absorbs fp32 rounding of the scale and a term
2^-23 |q*s| the fp32 rounding of the dequantized product.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashrl.quant.dispatch import quantize_weight
from flashrl.quant.primitives import (
    dequantize_per_block,
    dequantize_per_group,
    dequantize_per_row,
    dequantize_per_tensor,
    quantize_per_block,
    quantize_per_group,
    quantize_per_row,
    quantize_per_tensor,
)
from flashrl.quant.schemes import SCHEMES, get_scheme, parse_scheme_list

CODES = [torch.int8, torch.float8_e4m3fn]
SHAPES = [(1, 1), (3, 13), (15, 200), (128, 128), (130, 257), (300, 96)]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def random_weight(shape, gen, dtype=torch.float32, outliers=True):
    w = torch.randn(shape, generator=gen) * 0.02
    if outliers and w.numel() > 4:
        idx = torch.randint(0, w.numel(), (max(1, w.numel() // 500),), generator=gen)
        w.view(-1)[idx] *= 50.0
    return w.to(dtype)


def assert_within_quant_error(
    x: torch.Tensor, deq: torch.Tensor, scale_per_elem: torch.Tensor, code: torch.dtype
):
    x64, d64, s64 = x.double(), deq.double(), scale_per_elem.double()
    err = (x64 - d64).abs()
    if code == torch.int8:
        bound = s64 / 2
    else:
        bound = torch.maximum(x64.abs() * 2.0**-4, s64 * 2.0**-10)
    excess = err - bound * (1 + 1e-6) - d64.abs() * 2.0**-23
    assert excess.max() <= 0, (
        f"max excess over bound {excess.max().item():.3e} (max err {err.max().item():.3e})"
    )


def reference_codes(
    x: torch.Tensor, scale_per_elem: torch.Tensor, code: torch.dtype
) -> torch.Tensor:
    """The plain rule, written out: fp32 divide, (round,) clamp, cast."""
    y = x.float() / scale_per_elem
    if code == torch.int8:
        return torch.clamp(torch.round(y), -127, 127).to(torch.int8)
    return torch.clamp(y, -448, 448).to(torch.float8_e4m3fn)


def same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row(code, shape, dtype, gen):
    x = random_weight(shape, gen, dtype)
    q, s = quantize_per_row(x, code)
    assert q.dtype == code and s.shape == (shape[0], 1) and s.dtype == torch.float32
    amax64 = x.double().abs().amax(dim=1, keepdim=True).clamp_min(1e-10)
    torch.testing.assert_close(s.double(), amax64 / QMAX[code], rtol=2e-7, atol=0)
    assert same_codes(q, reference_codes(x, s, code))
    assert_within_quant_error(x, dequantize_per_row(q, s), s.expand(shape), code)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_per_tensor(code, shape, gen):
    x = random_weight(shape, gen, torch.bfloat16)
    q, s = quantize_per_tensor(x, code)
    assert s.shape == () and s.dtype == torch.float32
    assert math.isclose(
        s.item(), max(x.double().abs().max().item(), 1e-10) / QMAX[code], rel_tol=2e-7
    )
    assert same_codes(q, reference_codes(x, s, code))
    assert_within_quant_error(x, dequantize_per_tensor(q, s), s.expand(shape), code)


def loop_block_scales(w: torch.Tensor, block, qmax) -> torch.Tensor:
    n, k = w.shape
    rows, cols = math.ceil(n / block[0]), math.ceil(k / block[1])
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            out[i, j] = max(tile.double().abs().max().item(), 1e-10) / qmax
    return out


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_per_block_matches_loop_reference(code, shape, block, gen):
    w = random_weight(shape, gen, torch.bfloat16)
    q, s = quantize_per_block(w, code, block)
    assert s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    torch.testing.assert_close(
        s.double(), loop_block_scales(w, block, QMAX[code]), rtol=2e-7, atol=0
    )
    per_elem = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[
        :, : shape[1]
    ]
    assert same_codes(q, reference_codes(w, per_elem, code))
    assert_within_quant_error(w, dequantize_per_block(q, s, block), per_elem, code)


@pytest.mark.parametrize("code", CODES)
def test_partial_blocks_equal_zero_padded_blocks(code, gen):
    """A trailing partial block is quantized exactly as the zero-padded full block would be."""
    w = random_weight((130, 200), gen)
    padded = torch.nn.functional.pad(w, (0, 56, 0, 126))
    q, s = quantize_per_block(w, code)
    qp, sp = quantize_per_block(padded, code)
    assert torch.equal(s, sp)
    assert same_codes(q, qp[:130, :200].contiguous())


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("shape", [(1, 7), (5, 128), (16, 300), (33, 1000)])
def test_per_group(code, shape, gen):
    x = torch.randn(shape, generator=gen) * 3
    q, s = quantize_per_group(x, code, 128)
    groups = math.ceil(shape[1] / 128)
    assert s.shape == (shape[0], groups)
    ref = torch.stack(
        [
            x[:, g * 128 : (g + 1) * 128].double().abs().amax(1).clamp_min(1e-10)
            for g in range(groups)
        ],
        1,
    )
    torch.testing.assert_close(s.double(), ref / QMAX[code], rtol=2e-7, atol=0)
    per_elem = s.repeat_interleave(128, 1)[:, : shape[1]]
    assert same_codes(q, reference_codes(x, per_elem, code))
    assert_within_quant_error(x, dequantize_per_group(q, s, 128), per_elem, code)


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_in_place_outputs_equal_out_of_place(name, gen):
    scheme = get_scheme(name)
    w = random_weight((200, 136), gen, torch.bfloat16)
    q_ref, s_ref = quantize_weight(w, scheme)
    out = torch.empty_like(q_ref)
    scale_out = torch.full_like(s_ref, 123.0)
    q, s = quantize_weight(w, scheme, out=out, scale_out=scale_out)
    assert q is out and s is scale_out
    assert same_codes(out, q_ref) and torch.equal(scale_out, s_ref)


@pytest.mark.parametrize("code", CODES)
def test_zero_input_gives_zero_codes_and_finite_scale(code):
    q, s = quantize_per_row(torch.zeros(4, 9), code)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q.float() == 0).all()
    q, s = quantize_per_block(torch.zeros(3, 5), code)
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_fp8_codes_never_nan_and_int8_never_minus_128(gen):
    w = random_weight((64, 512), gen) * 1e4
    q8, _ = quantize_per_row(w, torch.int8)
    assert q8.min() >= -127
    qf, _ = quantize_per_tensor(w, torch.float8_e4m3fn)
    assert torch.isfinite(qf.float()).all() and qf.float().abs().max() <= 448


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_channel", "fp8_block"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_raise_with_count_and_position(name, bad):
    w = torch.randn(20, 30)
    w[3, 7] = bad
    w[11, 2] = bad
    with pytest.raises(ValueError, match=r"2 non-finite value\(s\).*\(3, 7\)"):
        quantize_weight(w, get_scheme(name))


def test_bad_inputs_raise_clear_errors():
    scheme = get_scheme("int8")
    with pytest.raises(TypeError, match="dtype torch.int8"):
        quantize_weight(torch.zeros(4, 4, dtype=torch.int8), scheme)
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.zeros(2, 4, 4), scheme)
    with pytest.raises(ValueError, match="expected shape"):
        quantize_weight(torch.zeros(4, 4), scheme, out=torch.empty(4, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="does not quantize weights"):
        quantize_weight(torch.zeros(4, 4), get_scheme("bf16"))


def test_scheme_lookup():
    assert set(SCHEMES) == {
        "bf16",
        "int8",
        "fp8",
        "fp8_channel",
        "fp8_block",
        "int8_g128",
        "int8_g64",
    }
    assert get_scheme(" INT8 ").name == "int8"
    with pytest.raises(ValueError, match="allowed: bf16, int8, fp8, fp8_channel, fp8_block"):
        get_scheme("int4")
    assert [s.name for s in parse_scheme_list("bf16, fp8_block")] == ["bf16", "fp8_block"]
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp16'"):
        parse_scheme_list("bf16,fp16")
