"""FP8 KV cache: storage numerics, calibration, recalibration after weight updates, memory, bench.

References and tolerances:

- Exactness of the fp8 path: an fp32 engine with an fp8 cache against an fp32 `transformers`
  forward in which every K (after q/k norm and RoPE) and V is replaced by the e4m3 round trip
  (restated in the test: fp32 ``clamp(x / s, -448, 448)`` -> e4m3 -> ``* s``) of the value the
  engine stored at that layer and position. Max |logit diff| < 1e-4 (measured ~1e-5). The engine's
  K/V equal transformers' only up to float rounding (~1e-6: decode steps run their GEMMs at other
  row counts and attend in another order, and MKL's SGEMM is not row-wise batch invariant on
  every CPU, e.g. AMD EPYC); rounding transformers' own values instead flips an occasional e4m3
  code, which these sharp models amplify to ~0.1. That the engine's K/V are transformers' up to
  1e-4 is asserted too. The unquantized forward differs by > 0.05, so the bound has teeth.
- Accuracy vs an unquantized cache, bf16 engine, "sharp" tiny models (weights ~ N(0, 0.2^2), so
  that attention and logits have real spread; the default tiny models are too flat to show
  anything). Measured mean KL(fp8-KV || bf16-KV) per token over 8 x 80 unseen teacher-forced
  tokens (4 seeds): Qwen2 (no q/k norm) 0.017-0.019 calibrated (layer or head scales), 0.010-0.012
  dynamic; Qwen3 0.0034-0.0042 calibrated, 0.0030-0.0035 dynamic. Bounds are about 2.5x those.
- Recalibration: a weight update that multiplies K by 16 (and Q by 1/16) and V by 16 (and
  o_proj by 1/16) leaves the model's function unchanged bit for bit, because 16 is a power of two.
  Recalibrated scales must be exactly 16x the old ones and the fp8 engine's logits bit-identical to
  before the update; the stale scales clip almost every K/V value (checked in the same test).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from flashrl.engine import SamplingParams
from flashrl.engine.kv_cache import KVCache
from flashrl.errors import CheckpointError, ConfigError
from flashrl.model.config import ModelConfig
from flashrl.model.kv_calibration import (
    KV_MARGIN,
    RecentSequences,
    calibrate_from_weights,
    calibrate_model,
    calibration_tensor_names,
    checkpoint_getter,
    rope_pair_amax,
    scales_from_amax,
)
from shorthand import build_engine

FP8 = torch.float8_e4m3fn


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    kwargs.setdefault("max_len", 256)
    return build_engine(path, **kwargs)


def sharp(tiny_models, family, **overrides):
    return tiny_models(family, initializer_range=0.2, **overrides)


def rollouts(e, gen, n=8, prompt_len=(8, 24), max_tokens=40, seed=0):
    prompts = [
        torch.randint(
            3, 256, (int(torch.randint(*prompt_len, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]
    outs = e.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)
    )
    return [o.prompt_ids for o in outs], [o.response_ids for o in outs]


def fake_quant(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The e4m3 round trip, restated independently in fp32: clamp(x / s, -448, 448) -> e4m3 -> * s,
    with s = `scale`, or per row amax / 448 when `scale` is None."""
    x = x.float()
    s = (
        x.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448
        if scale is None
        else torch.tensor(scale)
    )
    return (x / s).clamp(-448, 448).to(FP8).float() * s


# ------------------------------------------------------------------------------------------------
# the fp8 path is exactly "attention over e4m3-rounded K and V"
# ------------------------------------------------------------------------------------------------


def recorded_kv_writes(e, monkeypatch, run):
    """Call `run()` and return what the engine's cache was asked to store: {(layer, slot, position):
    (k, v)}, the fp32 vectors [kv_heads, head_dim] before quantization (the last write wins: the
    value later steps read; earlier ones are prefill padding)."""
    writes: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    prefill, decode = KVCache.write_prefill, KVCache.write_decode

    def write_prefill(cache, layer, slots, k, v):
        for row, slot in enumerate(slots.tolist()):
            for pos in range(k.shape[2]):
                writes[layer, slot, pos] = (k[row, :, pos].clone(), v[row, :, pos].clone())
        return prefill(cache, layer, slots, k, v)

    def write_decode(cache, layer, positions, k, v, valid=None):
        for slot, pos in enumerate(positions.tolist()):
            writes[layer, slot, pos] = (k[slot].clone(), v[slot].clone())
        return decode(cache, layer, positions, k, v, valid)

    with monkeypatch.context() as m:
        m.setattr(KVCache, "write_prefill", write_prefill)
        m.setattr(KVCache, "write_decode", write_decode)
        result = run()
    return result, writes


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("kv_scale", [0.02, "dynamic"])
def test_fp8_cache_equals_float64_fake_quant_reference(
    family, kv_scale, tiny_models, gen, monkeypatch
):
    path = sharp(tiny_models, family)
    e = engine(path, kv_cache_dtype="fp8", kv_scale=kv_scale, max_batch=4)
    prompts, responses = rollouts(e, gen, n=3, max_tokens=20)
    cached, writes = recorded_kv_writes(e, monkeypatch, lambda: e.cached_logits(prompts, responses))
    assert e.stats()["kv_clipped_values"] == 0, "test design: the fixed scale must not clip"
    scale = None if kv_scale == "dynamic" else kv_scale
    module = getattr(transformers.models, family).__dict__[f"modeling_{family}"]
    rope = module.apply_rotary_pos_emb
    # The reference rounds the K/V the engine computed, not its own. The engine's decode steps run
    # their GEMMs at M = sequences in the batch and attend over one query row, transformers runs
    # M = sequence length and full causal attention; the two fp32 results differ by float rounding
    # (~1e-6), and MKL's SGEMM is not row-wise batch invariant on every CPU (on AMD EPYC / Zen 4 an
    # SGEMM with fewer than 4 rows sums in another order). A value within that distance of an e4m3
    # rounding boundary then gets another code, which these sharp models amplify to ~0.08 in the
    # logits. Rounding the engine's own K/V keeps the test exact on every CPU; that they are the
    # values transformers computes, up to float rounding, is asserted below.
    current = {"layer": 0, "seq": 0}

    def engine_kv(layer: int, length: int, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, length, D] engine values of sequence current["seq"] and a mask of known positions."""
        slot = current["seq"]
        rows = [writes.get((layer, slot, pos)) for pos in range(length)]
        known = torch.tensor([r is not None for r in rows])
        like = next(r for r in rows if r is not None)[which]
        values = torch.stack(
            [r[which] if r is not None else torch.zeros_like(like) for r in rows], dim=1
        )
        return values, known

    def substitute(x: torch.Tensor, which: int) -> torch.Tensor:
        """x [1, kv_heads, T, D] (transformers' K or V) -> the engine's values where it stored them."""
        values, known = engine_kv(current["layer"], x.shape[2], which)
        assert (values[:, known] - x[0][:, known]).abs().max() < 1e-4, (
            "engine K/V are transformers' up to rounding"
        )
        return torch.where(known[None, None, :, None], values[None], x)

    def rope_then_quantize(
        q, k, cos, sin, *args, **kwargs
    ):  # k: [B, kv_heads, T, D] after q/k norm
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, fake_quant(substitute(k, 0), scale).to(k.dtype)

    def quantize_v(m, args, out):  # out: [1, T, kv_heads * D]
        v = out.unflatten(-1, (heads, dim)).transpose(1, 2)
        return fake_quant(substitute(v, 1), scale).transpose(1, 2).flatten(-2).to(out.dtype)

    monkeypatch.setattr(module, "apply_rotary_pos_emb", rope_then_quantize)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    heads, dim = (
        hf.config.num_key_value_heads,
        hf.config.hidden_size // hf.config.num_attention_heads,
    )
    dim = getattr(hf.config, "head_dim", None) or dim
    for i, layer in enumerate(hf.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, args, i=i: current.update(layer=i))
        layer.self_attn.v_proj.register_forward_hook(quantize_v)
    unquantized = engine(path)
    for i, (p, r, logits) in enumerate(zip(prompts, responses, cached)):
        current["seq"] = i
        with torch.no_grad():
            ref = hf(torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        assert (logits - ref).abs().max() < 1e-4
        assert (logits - unquantized.logits(p + r)[len(p) - 1 : -1]).abs().max() > 0.05


@pytest.mark.parametrize("kv_scale", [0.02, "dynamic"])
def test_prefill_and_decode_agree_and_logprobs_are_exact(kv_scale, tiny_models, gen):
    """A token's logits do not depend on whether it was prefilled or decoded, and the sampled
    logprobs equal `score` (which goes through the same fp8 cache)."""
    e = engine(sharp(tiny_models, "qwen2"), kv_cache_dtype="fp8", kv_scale=kv_scale, max_batch=4)
    prompts, responses = rollouts(e, gen, n=2, max_tokens=16)
    whole = e.cached_logits(prompts, responses)
    split = e.cached_logits(
        [p + r[:6] for p, r in zip(prompts, responses)], [r[6:] for r in responses]
    )
    for a, b in zip(whole, split):
        assert (a[6:] - b).abs().max() < 1e-4
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, n=2, seed=5, ignore_eos=True)
    for out in e.generate(prompts, params):
        scored = e.score(out.prompt_ids, out.response_ids, temperature=0.8, top_p=0.9)
        assert max(abs(a - b) for a, b in zip(out.logprobs, scored)) < 1e-4


@pytest.mark.parametrize("kv_scale", [0.02, "dynamic"])
def test_batching_and_shared_prefill_with_fp8(kv_scale, tiny_models, gen):
    """Slot copies (n samples share a prefill) and compaction move codes and per-token scales."""
    path = tiny_models("qwen3")
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 12, 7)]
    params = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)
    batched = engine(path, kv_cache_dtype="fp8", kv_scale=kv_scale, max_batch=6).generate(
        prompts, params
    )
    single = engine(path, kv_cache_dtype="fp8", kv_scale=kv_scale, max_batch=1)
    for prompt in prompts:
        alone = single.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )[0]
        for out in (r for r in batched if r.prompt_ids == prompt):
            assert out.response_ids == alone.response_ids
            assert max(abs(a - b) for a, b in zip(out.logprobs, alone.logprobs)) < 1e-5


def test_cache_write_read_numerics():
    """Static scales: read(write(x)) is the e4m3 round trip, clipped values are counted exactly;
    token scales: each (token, head) row is scaled by its own amax (no clipping)."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 5, 16, generator=gen)
    k[0, 1, 2, 3] = 50.0  # beyond 448 * 0.05 = 22.4: clipped
    cache = KVCache(1, 3, 2, 8, 16, torch.float32, "cpu", kv_cache_dtype="fp8")
    cache.set_scales(torch.tensor(0.05), torch.tensor(0.1))
    stored_k, stored_v = cache.write_prefill(0, torch.tensor([2, 0]), k, k / 2)  # v: 25 < 448 * 0.1
    expected = fake_quant(k, 0.05)
    assert torch.equal(stored_k, expected) and expected[0, 1, 2, 3] == 448 * torch.tensor(0.05)
    assert torch.equal(stored_v, fake_quant(k / 2, 0.1))
    rk, _ = cache.read(0, 3, 5)
    assert torch.equal(rk[2], expected[0]) and torch.equal(rk[0], expected[1])
    assert int(cache.clipped) == 1 and int(cache.written) == 2 * k.numel()
    new = torch.randn(3, 2, 16, generator=gen)
    cache.write_decode(0, torch.tensor([5, 6, 7]), new, new)
    assert torch.equal(cache.read(0, 3, 8)[1][1, :, 6], fake_quant(new[1], 0.1))
    token = KVCache(
        1, 2, 2, 8, 16, torch.float32, "cpu", kv_cache_dtype="fp8", scale_granularity="token"
    )
    stored, _ = token.write_prefill(0, torch.tensor([1]), k[:1], k[:1])
    assert torch.equal(stored, fake_quant(k[:1], None))
    assert torch.equal(token.read(0, 2, 5)[0][1], stored[0])
    assert int(token.clipped) == 0


# ------------------------------------------------------------------------------------------------
# accuracy against an unquantized cache
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,kv_scale,granularity,max_kl",
    [
        ("qwen2", "calibrated", None, 0.05),
        ("qwen2", "calibrated", "head", 0.05),
        ("qwen2", "dynamic", None, 0.03),
        ("qwen3", "calibrated", None, 0.01),
        ("qwen3", "dynamic", None, 0.01),
    ],
)
def test_fp8_kv_close_to_unquantized_kv(family, kv_scale, granularity, max_kl, tiny_models, gen):
    path = sharp(tiny_models, family)
    e = engine(
        path,
        dtype="bf16",
        kv_cache_dtype="fp8",
        kv_scale=kv_scale,
        kv_scale_granularity=granularity,
        max_batch=8,
        max_len=128,
    )
    rollouts(e, gen, n=8, max_tokens=40, seed=1)  # calibration set for the measurement below
    if kv_scale == "calibrated":
        e.calibrate_kv()
    prompts, responses = rollouts(e, gen, n=8, max_tokens=80, seed=2)  # unseen, longer
    m = e.kv_cache_mismatch(prompts, responses)
    assert m["tokens"] == 8 * 80
    assert 0 < m["kl"] < max_kl and m["k3_kl"] < max_kl
    assert e.stats()["kv_clipped_values"] == 0
    # a scale 100x too small clips nearly everything: the same metric must show it
    if kv_scale == "calibrated":
        e.cache.set_scales(e.cache.k_scale / 100, e.cache.v_scale / 100)
        assert e.kv_cache_mismatch(prompts, responses)["kl"] > 10 * m["kl"]


def test_bf16_kv_mismatch_is_zero(tiny_models, gen):
    e = engine(tiny_models("qwen2"), dtype="bf16")
    prompts, responses = rollouts(e, gen, n=2, max_tokens=8)
    m = e.kv_cache_mismatch(prompts, responses)
    assert m["kl"] == 0 and m["logit_abs_diff_max"] == 0


# ------------------------------------------------------------------------------------------------
# calibration and recalibration
# ------------------------------------------------------------------------------------------------


def scale_kv_projections(path, factor: float) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with K scaled by `factor` and Q by 1/factor (through q/k norm when
    the model has it, else q/k projections and biases), V by `factor` and o_proj by 1/factor: the
    same function, with K/V `factor` times larger."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    qk_norm = any(k.endswith("k_norm.weight") for k in state)
    for name, tensor in state.items():
        if ".self_attn." not in name:
            continue
        leaf = name.split(".self_attn.")[1]
        if leaf in (
            ("k_norm.weight",) if qk_norm else ("k_proj.weight", "k_proj.bias")
        ) or leaf.startswith("v_proj."):
            tensor.mul_(factor)
        elif (
            leaf in (("q_norm.weight",) if qk_norm else ("q_proj.weight", "q_proj.bias"))
            or leaf == "o_proj.weight"
        ):
            tensor.div_(factor)
    return state


@pytest.mark.parametrize(
    "family,quant",
    [("qwen2", "bf16"), ("qwen2", "int8"), ("qwen3", "bf16"), ("qwen3", "fp8_channel")],
)
def test_recalibration_after_update_that_scales_kv(family, quant, tiny_models, gen):
    path = sharp(tiny_models, family)
    e = engine(
        path, rollout_config=quant, dtype="bf16", kv_cache_dtype="fp8", max_batch=8, max_len=128
    )
    rollouts(e, gen, n=8, max_tokens=24, seed=1)  # fills the calibration set
    probe = rollouts(e, gen, n=4, max_tokens=24, seed=2)
    e.calibrate_kv()
    k0, v0 = e.cache.k_scale.clone(), e.cache.v_scale.clone()
    k_ptr = e.cache.k_scale.data_ptr()
    before = e.cached_logits(*probe)
    timing = e.update_weights(scale_kv_projections(path, 16.0).items())
    assert timing["kv_calibration_s"] > 0
    assert torch.equal(e.cache.k_scale, 16 * k0) and torch.equal(e.cache.v_scale, 16 * v0)
    assert e.cache.k_scale.data_ptr() == k_ptr, "scales must be updated in place"
    e.cache.clipped.zero_()
    after = e.cached_logits(*probe)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), (
        "fresh scales: the fp8 engine is unchanged"
    )
    assert int(e.cache.clipped) == 0
    e.cache.set_scales(k0, v0)  # what a skipped recalibration would leave
    stale = e.cached_logits(*probe)
    assert int(e.cache.clipped) > 0.05 * int(
        e.cache.written
    )  # values above amax_old / 8 (measured 9%)
    assert max(float((a - b).abs().mean()) for a, b in zip(before, stale)) > 0.1


def test_calibration_schedule_and_stats(tiny_models, gen):
    path = tiny_models("qwen2")
    e = engine(path, kv_cache_dtype="fp8", max_batch=4)
    assert e.stats()["kv_calibrations"] == 0
    update = {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=gen) * 0.02}
    assert e.update_weights(update)["kv_calibration_s"] == 0.0  # nothing generated yet: deferred
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    e.generate(prompts, SamplingParams(max_tokens=5, seed=0, ignore_eos=True))
    s = e.stats()
    assert (
        s["kv_calibrations"] == 1 and s["kv_calibration_tokens"] == 7
    )  # first generate: its prompts
    assert (
        s["kv_calibration_s"] > 0
        and s["kv_k_scale_mean"] > 0
        and s["kv_v_scale_max"] >= s["kv_v_scale_mean"]
    )
    timing = e.update_weights(update)
    s = e.stats()
    assert timing["kv_calibration_s"] == s["kv_calibration_last_s"] > 0
    assert (
        s["kv_calibrations"] == 2 and s["kv_calibration_tokens"] == 7 + 2 * 5
    )  # prompts + responses
    assert (
        engine(path).update_weights(update)["kv_calibration_s"] == 0.0
    )  # bf16 cache: key present, 0


def test_calibration_set_order_and_budget():
    recent = RecentSequences(max_tokens=10, max_seq_tokens=4)
    recent.add([[1, 2, 3, 4, 5, 6], [7, 8]])
    recent.add([[9, 9, 9]])
    assert recent.sequences() == [[9, 9, 9], [1, 2, 3, 4], [7, 8]]
    recent.add([[4] * 4, [5] * 4])
    assert recent.sequences() == [[4] * 4, [5] * 4, [9, 9]]
    with pytest.raises(ValueError, match="must be >= 1"):
        RecentSequences(max_tokens=0)


def test_rope_pair_amax_bounds_every_position():
    """The K statistic bounds the element amax of the same keys rotated to any position."""
    from flashrl.model.decoder import Rotary

    config = ModelConfig.from_dict(
        dict(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=8,
            hidden_size=64,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_theta=10000.0,
        )
    )
    rotary = Rotary(config, 4096, torch.device("cpu"))
    k = torch.randn(1, 1, 1, 32, generator=torch.Generator().manual_seed(0)).expand(1, 1, 4096, 32)
    rotated = rotary(k, torch.arange(4096)[None])
    bound = rope_pair_amax(k[:, :, :1]).max()
    assert rotated.abs().max() <= bound * (1 + 1e-6)
    assert rotated.abs().max() > 0.99 * bound  # and it is reached over many positions
    assert bound <= math.sqrt(2) * k.abs().max() * (1 + 1e-6)
    assert torch.equal(
        scales_from_amax(torch.tensor([224.0])), torch.tensor([224.0 * KV_MARGIN / 448])
    )
    with pytest.raises(ValueError, match="margin=0.5 must be >= 1"):
        scales_from_amax(torch.tensor([1.0]), margin=0.5)


@pytest.mark.parametrize(
    "family,quant", [("qwen2", "bf16"), ("qwen3", "int8"), ("mistral", "bf16")]
)
def test_layerwise_calibration_equals_model_calibration(family, quant, tiny_models, gen):
    """`calibrate_from_weights` (one layer at a time from named tensors: the vLLM backend's path)
    gives the statistics of a whole-model forward."""
    path = tiny_models(family, **({"sliding_window": 8} if family == "mistral" else {}))
    e = engine(path, rollout_config=quant)
    seqs = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 30, 17)]
    whole = calibrate_model(e.model, seqs, include_q=True)
    config = ModelConfig.from_model_dir(path)
    layered = calibrate_from_weights(
        checkpoint_getter(path), config, seqs, scheme=quant, dtype=torch.float32, include_q=True
    )
    for a, b in [(whole.k, layered.k), (whole.v, layered.v), (whole.q, layered.q)]:
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    assert whole.tokens == layered.tokens == 52
    names = calibration_tensor_names(config)
    assert (
        names[0] == "model.embed_tokens.weight" and "model.layers.1.mlp.down_proj.weight" in names
    )
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.9.mlp.down_proj.weight'"):
        checkpoint_getter(path)("model.layers.9.mlp.down_proj.weight")


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "granularity,scale_bytes", [("layer", 2 * 3 * 1 * 4), ("head", 2 * 3 * 4 * 4)]
)
def test_fp8_cache_is_half_of_bf16_plus_scales(granularity, scale_bytes):
    args = (3, 5, 4, 64, 32, torch.bfloat16, "cpu")
    bf16 = KVCache(*args)
    fp8 = KVCache(*args, kv_cache_dtype="fp8", scale_granularity=granularity)
    assert bf16.nbytes() == 2 * 3 * 5 * 4 * 64 * 32 * 2
    assert fp8.nbytes() == bf16.nbytes() // 2 + scale_bytes
    token = KVCache(*args, kv_cache_dtype="fp8", scale_granularity="token")
    assert (
        token.nbytes() == bf16.nbytes() // 2 + 2 * 3 * 5 * 4 * 64 * 4
    )  # + one fp32 per token and head
    per_token = {
        g: KVCache.bytes_per_token(3, 4, 32, torch.bfloat16, "fp8", g) for g in ("layer", "token")
    }
    assert (
        KVCache.bytes_per_token(3, 4, 32, torch.bfloat16)
        == 2 * per_token["layer"]
        == 2 * 3 * 4 * 32 * 2
    )
    assert per_token["token"] == 768 + 2 * 3 * 4 * 4
    budget = 1 << 20
    assert KVCache.capacity_tokens(budget, 3, 4, 32, torch.bfloat16) == budget // 1536 == 682
    assert (
        KVCache.capacity_tokens(budget, 3, 4, 32, torch.bfloat16, "fp8")
        == (budget - 24) // 768
        == 1365
    )


def test_kv_cache_memory_sizes_the_batch(tiny_models):
    path = tiny_models("qwen3")  # 2 layers, 2 kv heads, head_dim 32: 512 bytes per bf16 token
    budget = 512 * 100 * 10
    bf16 = engine(path, dtype="bf16", max_len=100, kv_cache_memory=budget)
    fp8 = engine(path, dtype="bf16", max_len=100, kv_cache_memory=budget, kv_cache_dtype="fp8")
    assert (bf16.max_batch, fp8.max_batch) == (10, 19)  # 16 scale bytes cost the 20th sequence
    fp8.generate([[5, 6, 7]], SamplingParams(max_tokens=2, seed=0))
    assert fp8.stats()["kv_cache_bytes"] <= budget
    assert fp8.stats()["kv_capacity_tokens"] == 1900 and fp8.stats()["kv_bytes_per_token"] == 256
    with pytest.raises(ValueError, match="holds 99 tokens, less than one sequence of max_len=100"):
        engine(path, dtype="bf16", max_len=100, kv_cache_memory=512 * 99)
    with pytest.raises(ValueError, match="max_batch or kv_cache_memory, not both"):
        engine(path, max_batch=4, kv_cache_memory=budget)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def test_bad_kv_options(tiny_models):
    path = tiny_models("qwen2")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp16' is invalid; allowed: bf16, fp8"):
        engine(path, kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match=r"kv_scale='auto' is invalid"):
        engine(path, kv_cache_dtype="fp8", kv_scale="auto")
    with pytest.raises(ValueError, match=r"kv_scale"):
        engine(path, kv_cache_dtype="fp8", kv_scale=-1.0)
    with pytest.raises(
        ValueError, match=r"kv_scale='dynamic' applies to kv_cache_dtype='fp8' only"
    ):
        engine(path, kv_scale="dynamic")
    with pytest.raises(
        ValueError, match=r"kv_scale_granularity applies to kv_cache_dtype='fp8' only"
    ):
        engine(path, kv_scale_granularity="head")
    with pytest.raises(
        ValueError, match=r"kv_scale_granularity='token' is invalid; allowed: layer, head"
    ):
        engine(path, kv_cache_dtype="fp8", kv_scale_granularity="token")
    with pytest.raises(ValueError, match=r"does not apply to kv_scale='dynamic'"):
        engine(path, kv_cache_dtype="fp8", kv_scale="dynamic", kv_scale_granularity="head")
    with pytest.raises(
        ValueError, match=r"calibrate_kv needs kv_cache_dtype='fp8' with kv_scale='calibrated'"
    ):
        engine(path, kv_cache_dtype="fp8", kv_scale=0.1).calibrate_kv([[1, 2, 3]])
    e = engine(path, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="no calibration sequences"):
        e.calibrate_kv()
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        e.calibrate_kv([[1, 999]])
    with pytest.raises(ValueError, match="set_scales needs an fp8 cache with layer or head scales"):
        KVCache(1, 1, 1, 4, 8, torch.float32, "cpu").set_scales(
            torch.tensor(1.0), torch.tensor(1.0)
        )
    with pytest.raises(ValueError, match="k_scale must be finite and positive"):
        KVCache(1, 1, 1, 4, 8, torch.float32, "cpu", "fp8").set_scales(
            torch.tensor(0.0), torch.tensor(1.0)
        )
    with pytest.raises(ValueError, match="one response per prompt"):
        e.cached_logits([[1, 2]], [])


def test_engine_reads_kv_fields_from_the_rollout_config(tiny_models, tmp_path):
    """The RolloutConfig fields are honoured (they were ignored before), and fields replaced in it
    win. A kv_scale other than the default on a cache that is not fp8 would do nothing: refused."""
    from flashrl.core.config import RolloutConfig

    path = tiny_models("qwen2")
    config = RolloutConfig(quant="int8", kv_cache_dtype="fp8", kv_scale="dynamic")
    e = engine(path, rollout_config=config)
    assert e.kv_scale_granularity == "token" and not e.kv_calibrated
    e.generate([[5, 6]], SamplingParams(max_tokens=2, seed=0))
    assert e.cache.k[0].dtype == FP8 and e.cache.k_token_scale
    yaml = config.to_yaml(tmp_path / "flashrl.yaml")
    assert engine(path, rollout_config=str(yaml), kv_scale="calibrated").kv_calibrated
    bf16 = engine(path, rollout_config=str(yaml), kv_cache_dtype="bf16", kv_scale="calibrated")
    assert bf16.config.kv_cache_dtype == "bf16"
    with pytest.raises(
        ConfigError, match=r"kv_scale='dynamic' applies to kv_cache_dtype='fp8' only"
    ):
        engine(path, rollout_config=str(yaml), kv_cache_dtype="bf16")  # kv_scale: dynamic


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------


def test_bench_reports_kv_rows_capacity_and_mismatch(tiny_models, tmp_path):
    from flashrl.tools.bench import BenchConfig, run_bench

    path = sharp(tiny_models, "qwen3")
    cfg = BenchConfig(
        model=str(path),
        quant="bf16",
        kv_cache_dtype="bf16,fp8",
        batch=4,
        prompt_len=8,
        output_len=16,
        device="cpu",
        dtype="bf16",
        kv_budget_gib=1 / 1024,
        out=None,
    )
    rows = run_bench(cfg).to_dict()["rows"]
    by_kv = {r["kv_cache_dtype"]: r for r in rows}
    assert set(by_kv) == {"bf16", "fp8"}
    assert by_kv["fp8"]["max_sequences"] >= 2 * by_kv["bf16"]["max_sequences"] - 1
    assert by_kv["bf16"]["max_sequences"] == (1 << 20) // (512 * 24)
    assert by_kv["bf16"]["kv_kl"] == 0 and 0 < by_kv["fp8"]["kv_kl"] < 0.05
    assert by_kv["fp8"]["kv_calibration_s"] > 0
    json.dumps(rows)
