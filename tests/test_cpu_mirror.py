"""The CPU fp32 weight mirror (`flashrl.quant.cpu_mirror`): outputs bit for bit those of the per-call
conversion for every scheme, never stale after an in-place write (requantize, a shard, stochastic
rounding, an engine update), and bounded by its memory budget."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flashrl.engine import Engine, EngineConfig
from flashrl.quant.cpu_mirror import Fp32Mirror, enable_mirrors
from flashrl.quant.linear import DenseLinear, QuantLinear

SCHEMES = ["int8", "int8_g64", "fp8", "fp8_channel", "fp8_block"]


def layer_pair(scheme, gen, shard_sizes=None, k=256, n=384):
    """Two identical layers of `scheme`, the second with its mirror enabled."""
    w = torch.randn(n, k, generator=gen) * 0.05
    layers = []
    for enabled in (False, True):
        layer = QuantLinear(k, n, scheme, shard_sizes=shard_sizes, dtype=torch.bfloat16)
        layer.requantize_(w)
        layer.fp32_mirror.enabled = enabled
        layers.append(layer)
    return layers


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shards", [None, (128, 256)])
def test_mirrored_output_is_bit_identical(scheme, shards, gen):
    plain, mirrored = layer_pair(scheme, gen, shards)
    x = torch.randn(2, 5, 256, generator=gen).bfloat16()
    for _ in range(2):  # the second call reads the mirror built by the first
        assert same(plain(x), mirrored(x))
    assert mirrored.fp32_mirror.nbytes == 384 * 256 * 4 and plain.fp32_mirror.nbytes == 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_mirror_follows_in_place_writes(scheme, gen):
    plain, mirrored = layer_pair(scheme, gen, (128, 256))
    x = torch.randn(7, 256, generator=gen).bfloat16()
    before = mirrored(x)
    writes = [
        lambda layer, w: layer.requantize_(w),
        lambda layer, w: layer.requantize_(w[128:], shard=1),  # rows of a view
        lambda layer, w: layer.requantize_(w, generator=torch.Generator().manual_seed(3)),
        lambda layer, w: layer.weight_scale.mul_(2),  # fp8_block's copy holds codes x scales
        lambda layer, w: layer.weight.zero_(),
    ]
    for write in writes:
        w = torch.randn(384, 256, generator=gen) * 0.05
        write(plain, w)
        write(mirrored, w)
        assert same(plain(x), mirrored(x))
    assert not same(before, mirrored(x))


def test_dense_linear_mirror(gen):
    plain, mirrored = (DenseLinear(256, 384, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(384, 256, generator=gen).bfloat16()
    for layer in (plain, mirrored):
        layer.weight.copy_(w)
    mirrored.fp32_mirror.enabled = True
    x = torch.randn(3, 256, generator=gen).bfloat16()
    assert same(plain(x), mirrored(x))
    for layer in (plain, mirrored):
        layer.requantize_(w * 2)
    assert same(plain(x), mirrored(x)) and same(mirrored(x), plain(x))


def test_replaced_tensor_is_not_served_from_the_old_mirror(gen):
    mirror = Fp32Mirror()
    mirror.enabled = True
    a = torch.randn(4, 4, generator=gen).bfloat16()
    assert torch.equal(mirror.get(a, lambda t: t.float()), a.float())
    b = a.clone() * 2  # another object, version 0 like `a` was
    assert torch.equal(mirror.get(b, lambda t: t.float()), b.float())


def test_budget_bounds_the_mirrors(gen):
    model = torch.nn.Sequential(*(QuantLinear(256, 256, "int8") for _ in range(3)))
    assert enable_mirrors(model, budget_bytes=2 * 256 * 256 * 4) == 2 * 256 * 256 * 4
    assert [m.fp32_mirror.enabled for m in model] == [True, True, False]
    assert enable_mirrors(model, budget_bytes=0) == 0
    assert not any(m.fp32_mirror.enabled for m in model)


@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8_block"])
def test_engine_update_matches_a_fresh_engine(scheme, tiny_models):
    """Mirrors built before an update serve the updated weights: an engine updated to another
    checkpoint gives the logits of an engine loaded from it."""
    first, second = tiny_models("qwen2", seed=0), tiny_models("qwen2", seed=1)
    config = EngineConfig(dtype="bf16", device="cpu", progress=False, max_len=64)
    updated, fresh = Engine(first, scheme, config), Engine(second, scheme, config)
    assert updated.mirror_bytes > 0
    ids = [1, 5, 9, 2, 7, 3]
    old = updated.logits(ids)  # builds the mirrors from the first checkpoint
    updated.update_weights(load_file(f"{second}/model.safetensors").items())
    new = updated.logits(ids)
    assert torch.equal(new, fresh.logits(ids)) and not torch.equal(new, old)


def test_engine_mirror_budget_is_an_engine_setting(tiny_models):
    """`EngineConfig.cpu_mirror_memory` bounds an engine's copies (0: none, outputs unchanged);
    a run's builtin backend gives each of N Ray workers a quarter of memory divided by N, and the
    trainer's own engine the default."""
    from flashrl.quant.cpu_mirror import DEFAULT_BUDGET_FRACTION, physical_memory_bytes
    from flashrl.rl.backends import BackendRequest, build_backend
    from flashrl.rl.config_build import build_config

    path = tiny_models("qwen2")
    base = dict(dtype="bf16", device="cpu", progress=False, max_len=64)
    full = Engine(path, "int8", EngineConfig(**base))
    off = Engine(path, "int8", EngineConfig(**base, cpu_mirror_memory=0))
    assert full.mirror_bytes > 0 and off.mirror_bytes == 0
    ids = [1, 5, 9, 2, 7, 3]
    assert torch.equal(full.logits(ids), off.logits(ids))
    some = Engine(path, "int8", EngineConfig(**base, cpu_mirror_memory=full.mirror_bytes // 2))
    assert 0 < some.mirror_bytes <= full.mirror_bytes // 2

    quarter = int(DEFAULT_BUDGET_FRACTION * physical_memory_bytes())
    for workers, budget in [(0, None), (4, quarter // 4)]:
        config = build_config("tiny-cpu", None, {"rollout.workers.count": workers})
        request = BackendRequest(config, path, torch.device("cpu"), 64, 4)
        assert build_backend(request).engine_config.cpu_mirror_memory == budget
