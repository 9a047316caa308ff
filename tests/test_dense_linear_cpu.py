"""`DenseLinear.forward` on the CPU: a bf16/fp16 layer multiplies in fp32 and rounds once; an fp32
layer is `F.linear` itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashrl.quant.linear import DenseLinear

IN, OUT = 96, 80


def layer(dtype: torch.dtype, gen: torch.Generator, bias: bool = True) -> DenseLinear:
    m = DenseLinear(IN, OUT, bias=bias, dtype=dtype, device="cpu")
    m.requantize_(torch.randn(OUT, IN, generator=gen) * 0.1)
    if bias:
        m.set_bias_(torch.randn(OUT, generator=gen) * 0.1)
    return m


def inputs(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(3, 7, IN, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_half_layer_is_fp32_product_rounded_once(dtype, bias, gen):
    m, x = layer(dtype, gen, bias), inputs(dtype, gen)
    y = m(x)
    b = None if m.bias is None else m.bias.float()
    assert y.dtype == dtype and y.shape == (3, 7, OUT)
    assert torch.equal(y, F.linear(x.float(), m.weight.float(), b).to(dtype))


def test_bf16_output_is_within_one_rounding_of_float64(gen):
    m, x = layer(torch.bfloat16, gen), inputs(torch.bfloat16, gen)
    y = m(x).double()
    x64, w64, b64 = x.double(), m.weight.double(), m.bias.double()
    ref = F.linear(x64, w64, b64)
    # one bf16 rounding (half an ulp: 2^-8 relative) plus fp32 accumulation over IN + 1 terms
    magnitude = F.linear(x64.abs(), w64.abs(), b64.abs())
    bound = 2**-8 * ref.abs() + (IN + 1) * 2**-24 * magnitude
    assert ((y - ref).abs() <= bound).all(), float(((y - ref).abs() - bound).max())
    assert (y - ref).abs().max() > 0  # the rounding happened: the check is not vacuous


def test_bf16_agrees_with_the_native_bf16_gemm(gen):
    m, x = layer(torch.bfloat16, gen), inputs(torch.bfloat16, gen)
    native = F.linear(x, m.weight, m.bias)
    same = (m(x) == native).float().mean().item()
    assert same >= 0.99, same


def test_fp32_layer_uses_the_native_path(gen, monkeypatch):
    m, x = layer(torch.float32, gen), inputs(torch.float32, gen)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    floats = []
    original = torch.Tensor.float

    def spy(self, *args, **kwargs):
        floats.append(self.dtype)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", spy)
    m(x)
    assert floats == []  # no fp32 copies: the layer is F.linear itself
