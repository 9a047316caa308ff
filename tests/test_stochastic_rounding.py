"""Stochastic rounding at weight sync (`flashrl.quant.stochastic`, ``sync_rounding: stochastic``).

References: the neighbour probabilities are the exact fractions of grid steps (binomial tolerance,
6 standard errors); unbiasedness is checked against the float64 target (mean of many draws within
6 standard errors of the mean, while nearest rounding is off by up to half a step); quantized codes
against `quantize_weight`'s nearest codes and scales (same scales bit for bit, codes at most one
grid step away).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from flashrl.core.config import RolloutConfig
from flashrl.engine import Engine, EngineConfig
from flashrl.errors import ConfigError
from flashrl.quant.linear import DenseLinear, QuantLinear
from flashrl.quant.schemes import get_scheme
from flashrl.quant.stochastic import _other_neighbour, round_to_dtype, stochastic_round_

BF16_ULP_AT_1 = 2.0**-7
E4M3_MIN_SUBNORMAL = 2.0**-9

CASES = [  # (target, grid dtype, its two neighbours a and b, the probability of b)
    (1 + 0.25 * BF16_ULP_AT_1, torch.bfloat16, 1.0, 1 + BF16_ULP_AT_1, 0.25),
    (-1 - 0.25 * BF16_ULP_AT_1, torch.bfloat16, -1.0, -1 - BF16_ULP_AT_1, 0.25),
    (1 + 0.75 * 2.0**-10, torch.float16, 1.0, 1 + 2.0**-10, 0.75),  # nearest is b
    (0.3 * E4M3_MIN_SUBNORMAL, torch.float8_e4m3fn, 0.0, E4M3_MIN_SUBNORMAL, 0.3),  # from zero
    (-0.3 * E4M3_MIN_SUBNORMAL, torch.float8_e4m3fn, 0.0, -E4M3_MIN_SUBNORMAL, 0.3),
    (1.9, torch.float8_e4m3fn, 1.875, 2.0, 0.2),  # below an exponent boundary: steps of 0.125
    (2.05, torch.float8_e4m3fn, 2.0, 2.25, 0.2),  # above it: steps of 0.25
    (3.3, torch.int8, 3.0, 4.0, 0.3),
    (-3.3, torch.int8, -3.0, -4.0, 0.3),
]


def nearest(target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return target.round().to(dtype) if dtype == torch.int8 else target.to(dtype)


@pytest.mark.parametrize("target,dtype,a,b,p", CASES)
def test_neighbour_probabilities(target, dtype, a, b, p):
    n = 40000
    t = torch.full((n,), target, dtype=torch.float64).float()
    out = stochastic_round_(nearest(t, dtype), t, torch.Generator().manual_seed(1)).double()
    assert set(out.unique().tolist()) <= {a, b}
    assert abs(float((out == b).double().mean()) - p) < 6 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("dtype,target", [(torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)])
def test_grid_edges_stay(dtype, target):
    t = torch.full((1000,), target)
    out = stochastic_round_(nearest(t, dtype), t, torch.Generator().manual_seed(0))
    assert torch.equal(out.float(), t)


def test_refuses_other_grids():
    with pytest.raises(TypeError, match="float32"):
        stochastic_round_(torch.zeros(3), torch.zeros(3), torch.Generator())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_rounding_is_unbiased(dtype, gen):
    x = torch.randn(512, generator=gen, dtype=torch.float64).float() * 3
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    step = (x.to(dtype).double().abs() * 2.0**-mantissa_bits).clamp_min(1e-30)
    draws = 400
    mean = sum(round_to_dtype(x, dtype, gen).double() for _ in range(draws)) / draws
    # each draw is within one step of x (variance <= step^2 / 4): 6 standard errors of the mean
    assert bool(((mean - x.double()).abs() <= 6 * step / (2 * math.sqrt(draws)) * 2).all())
    nearest_error = (x.to(dtype).double() - x.double()).abs() / step
    assert float(nearest_error.max()) > 0.3  # nearest rounding is biased by up to half a step
    assert torch.equal(round_to_dtype(x, dtype, None), x.to(dtype))


def fresh_layer(scheme: str, w: torch.Tensor) -> QuantLinear:
    layer = QuantLinear(w.shape[1], w.shape[0], get_scheme(scheme), device=torch.device("cpu"))
    layer.requantize_(w)
    return layer


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_quantized_codes_keep_scales_and_move_one_step(scheme, gen):
    w = torch.randn(256, 256, generator=gen) * 0.05
    reference = fresh_layer(scheme, w)
    layer = fresh_layer(scheme, w)
    layer.requantize_(w, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer.weight_scale, reference.weight_scale)
    codes_a, codes_b = layer.weight, reference.weight
    if scheme == "int8":
        assert int((codes_a.int() - codes_b.int()).abs().max()) == 1
    else:  # at most one step on the e4m3 grid: bit patterns of same-sign values differ by 1
        diff = (codes_a.view(torch.uint8).int() - codes_b.view(torch.uint8).int()).abs()
        assert int(diff[codes_a.float() * codes_b.float() > 0].max()) == 1
    assert (codes_a != codes_b).float().mean() > 0.1


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_quantized_rounding_is_unbiased(scheme, gen):
    """The mean dequantized weight over many stochastic syncs is the weight itself (each element
    within 6 standard errors, from its own grid step), where nearest rounding is off by up to half
    a step: an update of any size survives on average."""
    w = torch.randn(64, 256, generator=gen) * 0.05
    layer = fresh_layer(scheme, w)
    nearest_w = layer.dequantized_weight().double()
    per_code = nearest_w / layer.weight.double().where(layer.weight.float() != 0, 1)
    scale = per_code.abs().max(dim=1, keepdim=True).values if scheme != "fp8_block" else None
    if scale is None:  # blocks: the scale of each element's 128x128 block
        s = layer.weight_scale.double()
        scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:64, :256]
    qmax = 127.0 if scheme == "int8" else 448.0
    target = (w / scale.float()).clamp(-qmax, qmax)  # the quantizer's target, in code units
    up = _other_neighbour(layer.weight, target > layer.weight.float()).double()
    step = (up - layer.weight.double()).abs().nan_to_num(0.0) * scale  # NaN: past the range edge
    g, draws, total = torch.Generator().manual_seed(3), 300, torch.zeros_like(nearest_w)
    for _ in range(draws):
        layer.requantize_(w, generator=g)
        total += layer.dequantized_weight().double()
    error = (total / draws - w.double()).abs()
    assert bool((error <= 6 * step / (2 * math.sqrt(draws)) + 1e-9).all())
    assert float(error.mean()) < 0.2 * float((nearest_w - w.double()).abs().mean())


def test_dense_linear_rounds_stochastically(gen):
    layer = DenseLinear(64, 32, dtype=torch.bfloat16, device=torch.device("cpu"))
    w = torch.randn(32, 64, generator=gen)
    layer.requantize_(w)
    assert torch.equal(layer.weight, w.to(torch.bfloat16))
    layer.requantize_(w, generator=torch.Generator().manual_seed(0))
    assert (layer.weight != w.to(torch.bfloat16)).any()
    assert ((layer.weight.float() - w).abs() <= w.abs() * 2.0**-7).all()


# ------------------------------------------------------------------ the engine and its config


def small_update(path, gen) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor plus fp32 noise of 1e-4 relative: below half a bf16 step."""
    tensors = load_file(str(path / "model.safetensors"))
    return [
        (name, value.float() * (1 + 1e-4 * torch.randn(value.shape, generator=gen)))
        for name, value in sorted(tensors.items())
    ]


def test_engine_sync_rounding(tiny_models, gen):
    """A bf16 engine fed an fp32 trainer's small update: nearest rounding stores none of it, as in a
    real run where 88% of weights kept their bf16 value; stochastic rounding stores part of it, the
    same part for the same seed."""
    path = tiny_models("qwen2", dtype=torch.bfloat16)  # weights on the bf16 grid, as a checkpoint
    bf16 = EngineConfig(dtype="bf16", device="cpu", progress=False)
    nearest_engine = Engine(path, engine_config=bf16)
    stochastic = [
        Engine(path, RolloutConfig(sync_rounding="stochastic"), replace(bf16, seed=5))
        for _ in range(2)
    ]
    update = small_update(path, gen)
    assert nearest_engine.update_weights(update, count_changed=True)["dense_changed_frac"] == 0.0
    fractions = [
        e.update_weights(update, count_changed=True)["dense_changed_frac"] for e in stochastic
    ]
    assert fractions[0] > 0.005
    a, b = (dict(e.model.state_dict()) for e in stochastic)
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, same update: same weights"


def test_sync_rounding_config_errors(tiny_models):
    with pytest.raises(ConfigError, match="sync_rounding='up'.*nearest, stochastic"):
        RolloutConfig(sync_rounding="up")
    with pytest.raises(ConfigError, match="not supported for MoE"):
        Engine(
            tiny_models("qwen3_moe"),
            RolloutConfig(sync_rounding="stochastic"),
            EngineConfig(device="cpu", progress=False),
        )
    from flashrl.vllm_backend.config import engine_kwargs

    with pytest.raises(ValueError, match="sync_rounding='stochastic' is not supported by the vLLM"):
        engine_kwargs(RolloutConfig(quant="int8", sync_rounding="stochastic"))


def test_loading_fp32_weights_rounds_stochastically_too(tiny_models):
    """A resumed run loads the trainer's fp32 weights from its checkpoint: nearest rounding of those
    is the lag again (on SmolLM2, k3 0.040 at the first step after a resume, 0.001 after the next
    sync), so an engine with stochastic rounding also rounds what it loads."""
    path = tiny_models("qwen2")  # fp32 weights: off the bf16 grid
    bf16 = EngineConfig(dtype="bf16", device="cpu", progress=False)
    nearest = Engine(path, engine_config=bf16)
    stochastic = Engine(path, RolloutConfig(sync_rounding="stochastic"), replace(bf16, seed=1))
    tensors = load_file(str(path / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    a = nearest.model.state_dict()["embed_tokens.weight"]
    b = stochastic.model.state_dict()["embed_tokens.weight"]
    assert torch.equal(a, embed.to(torch.bfloat16))
    assert (b != a).float().mean() > 0.2
    assert ((b.float() - embed).abs() <= embed.abs() * 2.0**-7 + 1e-30).all()
