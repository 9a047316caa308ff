"""QuantLinear: in-place re-quantization, shard updates, and quantize_ on tiny transformers models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from flashrl.quant import QuantLinear, quantize_
from flashrl.quant.linear import matches_any
from flashrl.testing import save_tiny_model

QUANT = ["int8", "fp8", "fp8_channel", "fp8_block", "int8_g128", "int8_g64"]


def buffers_of(layer: QuantLinear) -> dict[str, torch.Tensor]:
    return {name: b for name, b in layer.named_buffers()}


def assert_same_layer(a: QuantLinear, b: QuantLinear) -> None:
    for name, buf in buffers_of(a).items():
        other = buffers_of(b)[name]
        assert torch.equal(
            buf.view(torch.uint8) if buf.element_size() == 1 else buf,
            other.view(torch.uint8) if other.element_size() == 1 else other,
        ), name


def linear(
    n: int, k: int, gen: torch.Generator, bias: bool = True, dtype=torch.bfloat16
) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return layer.to(dtype)


@pytest.mark.parametrize("scheme", QUANT)
@pytest.mark.parametrize("shards", [None, (96, 32, 32)])
def test_requantize_in_place_equals_fresh_layer(scheme, shards, gen):
    base = linear(160, 200, gen)
    layer = QuantLinear.from_linear(base, scheme, shard_sizes=shards)
    ptrs = {name: b.data_ptr() for name, b in layer.named_buffers()}
    new = linear(160, 200, gen)  # a different weight with a different max per row / block / tensor
    layer.requantize_(new.weight.detach())
    layer.set_bias_(new.bias.detach())
    assert {name: b.data_ptr() for name, b in layer.named_buffers()} == ptrs, "storage moved"
    fresh = QuantLinear.from_linear(new, scheme, shard_sizes=shards)
    assert_same_layer(layer, fresh)
    x = torch.randn(3, 5, 200, generator=gen).to(torch.bfloat16)
    assert torch.equal(layer(x), fresh(x))


@pytest.mark.parametrize("scheme", QUANT)
def test_scales_shrink_with_the_weights(scheme, gen):
    base = linear(256, 256, gen, bias=False, dtype=torch.float32)
    layer = QuantLinear.from_linear(base, scheme)
    before = layer.weight_scale.clone()
    layer.requantize_(base.weight.detach() * 0.5)
    # halving is exact in binary floating point, so fresh scales are exactly half (no stale max)
    assert torch.equal(layer.weight_scale, before * 0.5)


@pytest.mark.parametrize("scheme", QUANT)
def test_shard_update_keeps_other_shards_and_equals_fresh_fused(scheme, gen):
    sizes = (64, 32, 32)
    q, k, v = (linear(n, 96, gen) for n in sizes)
    fused = nn.Linear(96, 128, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
    layer = QuantLinear.from_linear(fused, scheme, shard_sizes=sizes)
    q_codes = layer.weight[:64].clone()
    new_k = torch.randn(32, 96, generator=gen).to(torch.bfloat16) * 0.05
    layer.requantize_(new_k, shard=1)
    assert torch.equal(layer.weight[:64].view(torch.uint8), q_codes.view(torch.uint8))
    with torch.no_grad():
        fused.weight[64:96] = new_k
    fresh = QuantLinear.from_linear(fused, scheme, shard_sizes=sizes)
    assert_same_layer(layer, fresh)


def test_count_changed_codes(gen):
    base = linear(64, 64, gen, bias=False, dtype=torch.float32)
    layer = QuantLinear.from_linear(base, "int8")
    assert layer.requantize_(base.weight.detach(), count_changed=True) == 0
    w = base.weight.detach().clone()
    row_max = w.abs().argmax(dim=1)
    w[5, (row_max[5] + 1) % 64] += (
        0.5 * layer.weight_scale[5, 0] * 3
    )  # moves at least one code of row 5
    changed = layer.requantize_(w, count_changed=True)
    assert changed >= 1
    assert changed == int((QuantLinear.from_linear(base, "int8").weight != layer.weight).sum())


def test_bad_inputs():
    layer = QuantLinear(16, 8, "int8")
    with pytest.raises(ValueError, match=r"shape \(8, 15\); expected \(8, 16\)"):
        layer.requantize_(torch.zeros(8, 15))
    with pytest.raises(TypeError, match="dtype torch.int8"):
        layer.requantize_(torch.zeros(8, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="2-D"):
        layer.requantize_(torch.zeros(8, 16, 1))
    w = torch.zeros(8, 16)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\).*\(2, 3\)"):
        layer.requantize_(w)
    with pytest.raises(ValueError, match="allowed: bf16, int8"):
        QuantLinear(16, 8, "int4")
    with pytest.raises(ValueError, match="does not quantize"):
        QuantLinear(16, 8, "bf16")
    with pytest.raises(ValueError, match="sum to out_features"):
        QuantLinear(16, 8, "fp8", shard_sizes=(4, 3))
    with pytest.raises(IndexError, match="shard 3 out of range"):
        QuantLinear(16, 8, "fp8", shard_sizes=(4, 4)).requantize_(torch.zeros(4, 16), shard=3)


def test_skip_patterns():
    assert matches_any("lm_head", ["lm_head"])
    assert matches_any("model.layers.0.mlp.down_proj", ["*down_proj"])
    assert matches_any("model.layers.0.mlp.down_proj", ["mlp.down_proj"])
    assert matches_any("model.layers.11.self_attn.q_proj", ["re:layers\\.1[01]\\."])
    assert not matches_any("model.layers.0.mlp.gate_proj", ["*.mlp.gate"])


# Relative Frobenius error of the logits against the fp32 model on a tiny random model
# (hidden 256, 2 layers). Measured: bf16 model 0.008; int8 0.021; fp8 0.062-0.075;
# fp8_channel 0.065-0.071; fp8_block 0.068-0.071. Bounds are about 1.7x the measured values.
LOGIT_TOLERANCE = {"bf16": 0.015, "int8": 0.04, "fp8": 0.12, "fp8_channel": 0.12, "fp8_block": 0.12,
                   "int8_g128": 0.04, "int8_g64": 0.04}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_quantize_tiny_transformers_model(family, tmp_path):
    import transformers

    save_tiny_model(tmp_path, family, hidden_size=256, intermediate_size=512)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(ids).logits.double()
        assert ((model(ids).logits.double() - ref).norm() / ref.norm()) < LOGIT_TOLERANCE["bf16"]
    n_layers = reference.config.num_hidden_layers
    for scheme in ["bf16", *QUANT]:
        quantized = copy.deepcopy(model)
        report = quantize_(quantized, scheme)
        with torch.no_grad():
            err = ((quantized(ids).logits.double() - ref).norm() / ref.norm()).item()
        assert err < LOGIT_TOLERANCE[scheme], f"{family} {scheme}: relative logit error {err:.4f}"
        # report: 7 linear layers per decoder block; lm_head kept
        expected_layers = 0 if scheme == "bf16" else 7 * n_layers
        assert report.layers_quantized == expected_layers
        assert "lm_head" in report.skipped
        qlayers = [m for m in quantized.modules() if isinstance(m, QuantLinear)]
        assert len(qlayers) == expected_layers
        removed = sum(m.in_features * m.out_features * 2 for m in qlayers)  # bf16 weights gone
        added = sum(m.nbytes() - (m.bias.numel() * 2 if m.bias is not None else 0) for m in qlayers)
        assert report.bytes_before - report.bytes_after == removed - added
        assert (
            isinstance(quantized.lm_head, nn.Linear)
            and type(quantized.model.embed_tokens) is nn.Embedding
        )
