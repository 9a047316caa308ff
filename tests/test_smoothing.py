"""Online smoothing (``rollout.smooth``; `flashrl.quant.smoothing`, `flashrl.model.smoothing`).

References: SmoothQuant's factor formula in float64; the smoothed layer's codes bit for bit against
`quantize_weight` of ``W * s`` and its output against the float64 product of the dequantized
smoothed operands; engine-level errors against an fp32 engine on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flashrl.core.config import RolloutConfig
from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.errors import ConfigError
from flashrl.quant.dispatch import quantize_activation, quantize_weight
from flashrl.quant.linear import QuantLinear
from flashrl.quant.primitives import dequantize_per_row
from flashrl.quant.schemes import get_scheme
from flashrl.quant.smoothing import enable_smoothing_, refresh_, smoothing_factors


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def outlier_input(gen: torch.Generator, rows: int = 12, k: int = 64, channel: int = 5):
    x = torch.randn(rows, k, generator=gen)
    x[:, channel] *= 60.0
    return x


def test_factors_formula_dead_channels_and_clamp():
    act = torch.tensor([4.0, 0.0, 1e-9, 1e9])
    wgt = torch.tensor([0.25, 0.5, 1.0, 1e-9])
    s = smoothing_factors(act, wgt, 0.5)
    expected = (act.double().clamp_min(1e-5) ** 0.5) / (wgt.double().clamp_min(1e-5) ** 0.5)
    assert abs(float(s[0]) - float(expected[0])) < 1e-6 * float(expected[0])  # 4^.5 / .25^.5 = 4
    assert float(s[1]) == 1.0  # never observed: no smoothing
    assert abs(float(s[2]) - float(expected[2])) < 1e-6 * float(expected[2])  # floored, not 0
    assert float(s[3]) == 1e4  # clamped: an absurd factor would wreck the weight column


def test_smoothed_layer_codes_and_output_against_fp64(gen):
    k, n = 64, 32
    w = torch.randn(n, k, generator=gen) * 0.05
    layer = QuantLinear(k, n, "int8", dtype=torch.float32)
    enable_smoothing_(layer)
    layer.requantize_(w)
    x = outlier_input(gen, k=k)
    layer(x)  # statistics
    assert torch.equal(layer.act_amax, x.abs().amax(0))
    assert refresh_(layer, [w], 0.5)
    s64 = (x.double().abs().amax(0) ** 0.5) / (w.double().abs().amax(0) ** 0.5)
    assert rel_err(layer.smooth, s64) < 1e-6
    assert not bool(layer.act_amax.any())  # a new statistics window
    layer.requantize_(w)
    wq, sw = quantize_weight(w.float() * layer.smooth, get_scheme("int8"))
    assert torch.equal(layer.weight, wq) and torch.equal(layer.weight_scale, sw)
    y = layer(x)
    xq, sx = quantize_activation(x.float() / layer.smooth, get_scheme("int8"))
    ref = dequantize_per_row(xq, sx, torch.float64) @ dequantize_per_row(wq, sw, torch.float64).t()
    assert rel_err(y, ref) < 1e-6
    assert rel_err(layer.dequantized_weight(), w) < 0.02  # W*s/s: the weight it stands for
    plain = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), "int8")
    plain.requantize_(w)
    exact = x.double() @ w.double().t()
    assert rel_err(y, exact) < 0.5 * rel_err(plain(x), exact)  # the point of smoothing


def test_refresh_without_statistics_keeps_factors(gen):
    layer = QuantLinear(64, 16, "int8", dtype=torch.float32)
    enable_smoothing_(layer)
    assert not refresh_(layer, [torch.randn(16, 64, generator=gen)], 0.5)
    assert torch.equal(layer.smooth, torch.ones(64))


# ---------------------------------------------------------------------------------- engine


def outlier_state(base, channel: int, size: float = 100.0) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with one hidden channel of every layer norm made large: an
    activation outlier channel into q/k/v and gate/up (and, through them, further)."""
    state = load_file(str(base / "model.safetensors"))
    for name, t in state.items():
        if name.endswith("layernorm.weight"):
            t.fill_(1.0)
            t[channel] = size
    return state


def fp32_engine(base, scheme="int8", smooth=None) -> Engine:
    config = RolloutConfig(quant=scheme, smooth=smooth)
    return Engine(
        base, config, EngineConfig(device="cpu", dtype="fp32", progress=False, max_len=64)
    )


PROMPTS = [[5, 9, 13, 2, 7, 7, 30], [11, 3, 3, 40, 8]]


def rollouts(e: Engine, seed: int = 0):
    return e.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=seed)
    )


def logits_err(e: Engine, ref: Engine, seqs) -> float:
    return sum(rel_err(e.logits(s), ref.logits(s)) for s in seqs) / len(seqs)


def test_engine_calibrates_before_first_rollout_and_logprobs_stay_exact(tiny_models):
    base = tiny_models("llama", tie_word_embeddings=False)
    e = fp32_engine(base, smooth=0.5)
    layers = [m for m in e.model.modules() if isinstance(m, QuantLinear)]
    assert e.smoothing.pending and all(
        torch.equal(m.smooth, torch.ones_like(m.smooth)) for m in layers
    )
    out = rollouts(e)
    assert not e.smoothing.pending and e.smoothing.refreshed_layers == len(layers)
    assert all(not torch.equal(m.smooth, torch.ones_like(m.smooth)) for m in layers)
    for r in out:  # what it reports is what it sampled from
        scored = torch.tensor(e.score(r.prompt_ids, r.response_ids))
        assert (scored - torch.tensor(r.logprobs)).abs().max() < 1e-4


def test_partial_update_keeps_factors_and_full_update_refreshes(tiny_models, gen):
    base = tiny_models("llama", tie_word_embeddings=False)
    e = fp32_engine(base, smooth=0.5)
    rollouts(e)
    qkv = e.model.layers[0].self_attn.qkv_proj
    s0, codes0 = qkv.smooth.clone(), qkv.weight.clone()
    state = load_file(str(base / "model.safetensors"))
    p = "model.layers.0.self_attn."
    new = {n: state[p + n] + 0.01 * torch.randn(state[p + n].shape, generator=gen)
           for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}  # fmt: skip
    e.update_weights([(p + "q_proj.weight", new["q_proj.weight"])])
    assert torch.equal(qkv.smooth, s0) and e.smoothing.refreshed_layers == 0
    q_rows = qkv.shard_sizes[0]
    assert torch.equal(qkv.weight[q_rows:], codes0[q_rows:])  # k and v: untouched
    expected, _ = quantize_weight(new["q_proj.weight"].float() * s0, get_scheme("int8"))
    assert torch.equal(qkv.weight[:q_rows], expected)  # q: encoded with the kept factors
    rollouts(e, seed=1)
    e.update_weights([(p + n, t) for n, t in new.items()])
    assert e.smoothing.refreshed_layers == 1 and not torch.equal(qkv.smooth, s0)


def test_fresh_factors_beat_stale_ones_after_the_outliers_move(tiny_models):
    """Factors frozen at the first weights (as an offline calibration would be) against factors
    recomputed at every sync, after an update moves the outlier channel elsewhere."""
    base = tiny_models("llama", tie_word_embeddings=False, hidden_size=64)
    before, after = outlier_state(base, channel=3), outlier_state(base, channel=40)
    fresh, stale, plain = (fp32_engine(base, smooth=0.5), fp32_engine(base, smooth=0.5),
                           fp32_engine(base))  # fmt: skip
    ref = fp32_engine(base, "bf16")
    for e in (fresh, stale):
        e.update_weights(before.items())
        rollouts(e)
        e.update_weights(before.items())  # factors for `before`
    stale.smoothing.alpha = None  # frozen from here on
    for e in (fresh, stale, plain, ref):
        e.update_weights(after.items())
        out = rollouts(e, seed=2)
        e.update_weights(after.items())
    seqs = [r.prompt_ids + r.response_ids for r in out]
    err = {name: logits_err(e, ref, seqs) for name, e in
           (("fresh", fresh), ("stale", stale), ("plain", plain))}  # fmt: skip
    assert err["fresh"] < 0.7 * err["stale"], err
    assert err["fresh"] < 0.7 * err["plain"], err


def test_smoothing_config_errors(tiny_models):
    for bad in (0, 1.5, -0.5, True, "half"):
        with pytest.raises(
            ConfigError, match=r"smooth=.* is invalid; allowed: a number in \(0, 1\]"
        ):
            RolloutConfig(quant="int8", smooth=bad)
    with pytest.raises(ConfigError, match="smooth needs a quantized scheme"):
        RolloutConfig(quant="bf16", smooth=0.5)
    with pytest.raises(ConfigError, match="not supported for MoE models"):
        Engine(
            tiny_models("qwen3_moe"),
            RolloutConfig(quant="int8", smooth=0.5),
            EngineConfig(device="cpu", progress=False),
        )
    from flashrl.vllm_backend.config import engine_kwargs  # the vLLM plugin smooths too

    quant_config = engine_kwargs(RolloutConfig(quant="int8", smooth=0.5))["hf_overrides"]
    assert quant_config["quantization_config"]["smooth"] == 0.5


@pytest.mark.parametrize(
    "rollout", [{"rollout.smooth": "0.5"}, {"rollout.sync_rounding": "stochastic"}]
)
def test_train_config_refuses_trainer_made_codes_with_worker_only_rounding(rollout):
    """With rollout.workers.payload=codes the trainer quantizes (nearest, unsmoothed): smoothing or
    stochastic rounding on the workers would be silently lost, so the config is refused."""
    from flashrl.rl.config_build import build_config

    flags = {"rollout.quant": "int8", **rollout}
    assert build_config("tiny-cpu", None, flags).rollout.quant == "int8"  # fine with stream
    # smoothing is refused on workers at all (their stream never refreshes the factors)
    message = "sends codes the trainer rounds|runs in the trainer's own engine only"
    with pytest.raises(ConfigError, match=message):
        build_config(
            "tiny-cpu",
            None,
            {**flags, "rollout.workers.count": "1", "rollout.workers.payload": "codes"},
        )


def test_train_config_refuses_smoothing_on_ray_workers():
    from flashrl.rl.config_build import build_config

    flags = {"rollout.quant": "int8", "rollout.smooth": "0.5", "rollout.workers.count": "2"}
    with pytest.raises(ConfigError, match="rollout.smooth=0.5 runs in the trainer's own engine"):
        build_config("tiny-cpu", None, flags)
