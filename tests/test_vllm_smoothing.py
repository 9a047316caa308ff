"""Online smoothing (``rollout.smooth``) in the vLLM plugin (`flashrl.vllm_backend.smoothing`).

References: the built-in engine's `QuantLinear` with the same weights, statistics and exponent
(codes, scales and factors bit for bit); the float64 product of the quantized, smoothed operands
(to the rounding of a bf16 output) and of the new weights themselves (to int8's error); an fp32
engine for the end-to-end mismatch. Tiny random Qwen2 (q/k/v biases, tied embeddings, head_dim 32
for vLLM's CPU attention) whose layer norms carry one outlier channel, in-process engines with
``enforce_eager=True`` (one compiled engine checks the custom op under torch.compile).
"""

from __future__ import annotations

import gc
import random
import shutil
from contextlib import contextmanager

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()

from safetensors.torch import load_file, save_file  # noqa: E402

from flashrl.core.config import RolloutConfig  # noqa: E402
from flashrl.errors import ConfigError, WeightError  # noqa: E402
from flashrl.quant.dispatch import quantize_activation  # noqa: E402
from flashrl.quant.linear import QuantLinear  # noqa: E402
from flashrl.quant.schemes import get_scheme  # noqa: E402
from flashrl.quant.smoothing import enable_smoothing_, refresh_  # noqa: E402
from flashrl.vllm_backend import engine_kwargs  # noqa: E402
from flashrl.vllm_backend import smoothing as vsmoothing  # noqa: E402
from flashrl.vllm_backend.testing import save_tiny_vllm_model  # noqa: E402
from flashrl.vllm_backend.weight_update import WeightUpdater  # noqa: E402

ALPHA = 0.5
QUANT_SCHEMES = ("int8", "fp8", "fp8_channel", "fp8_block", "int8_g64")
PROMPTS = ["Hello world", "The quick brown fox", "1+1=", "abc def"]
LLM_ARGS = dict(enforce_eager=True, max_model_len=128, seed=0, max_num_seqs=8)
DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXACT_TOL = 4e-3
"""Output against the float64 product of the layer's own quantized operands (x / s quantized as the
scheme does, the dequantized codes of W * s): only the bf16 rounding of the output separates them
(2^-9 per element)."""
WEIGHT_TOL = 0.05
"""Output against the float64 product with the new weight itself: int8 / fp8 quantization error."""
KERNEL_TOL = 0.05
"""A vLLM kernel against flashrl's op on the same codes (`flashrl.vllm_backend.kernels`)."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def with_outlier(state: dict[str, torch.Tensor], channel: int, size: float = 30.0) -> dict:
    """`state` with every layer norm set to 1 except one hidden channel set to `size`: an activation
    outlier channel into q/k/v and gate/up."""
    state = {name: t.clone() for name, t in state.items()}
    for name, t in state.items():
        if name.endswith("layernorm.weight"):
            t.fill_(1.0)
            t[channel] = size
    return state


def save_state(src, dst, state: dict[str, torch.Tensor]):
    """A copy of the checkpoint directory `src` (config, tokenizer) holding `state`."""
    shutil.copytree(src, dst)
    save_file({n: t.contiguous() for n, t in state.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``a``: outlier channel 3; ``b``: every weight moved (noise of 0.2 std) and the outlier at
    channel 40. State dicts in checkpoint names, fp32, as a trainer sends them."""
    root = tmp_path_factory.mktemp("vllm_smooth")
    base = save_tiny_vllm_model(root / "base", family="qwen2", seed=0, **DIMS)
    raw = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    moved = {n: t + 0.2 * float(t.std()) * torch.randn(t.shape, generator=gen)
             for n, t in raw.items()}  # fmt: skip
    states = {"a": with_outlier(raw, 3), "b": with_outlier(moved, 40)}
    out = {which: save_state(base, root / which, s) for which, s in states.items()}
    for which, s in states.items():
        out[f"{which}_sd"] = {("model." + n if not n.startswith("model.") else n): t
                              for n, t in s.items() if n != "lm_head.weight"}  # fmt: skip
    return out


@contextmanager
def engine(path, scheme="int8", smooth=ALPHA, dtype="bfloat16", **kw):
    """An in-process ``vllm.LLM`` of `scheme` with smoothing `smooth`, shut down on exit."""
    config = RolloutConfig(quant=scheme, smooth=smooth if scheme != "bf16" else None)
    llm = vllm.LLM(str(path), **engine_kwargs(config), dtype=dtype, **{**LLM_ARGS, **kw})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def model_of(llm):
    return llm.apply_model(lambda model: model)[0]


def smoothed(llm) -> dict[str, torch.nn.Module]:
    return {
        name: m
        for name, m in model_of(llm).named_modules()
        if vsmoothing.layer_smoothing(m) is not None
    }


def generate(llm, seed: int = 0) -> list[list[int]]:
    """Sampled rollouts (statistics for the next refresh); returns prompt + response ids."""
    params = vllm.SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def windows(llm) -> dict[str, torch.Tensor]:
    """Each smoothed layer's current statistics window (what the next refresh will use)."""
    return {n: vsmoothing.layer_smoothing(m).act_amax.clone() for n, m in smoothed(llm).items()}


def factors(llm) -> dict[str, torch.Tensor]:
    return {n: vsmoothing.layer_smoothing(m).smooth.clone() for n, m in smoothed(llm).items()}


def checkpoint_shards(name: str, state: dict, dtype: torch.dtype):
    """The checkpoint tensors vLLM fuses into layer `name` (weights, biases or None), in `dtype`."""
    parent, _, leaf = name.rpartition(".")
    parts = PARTS.get(leaf, (leaf,))
    weights = [state[f"{parent}.{p}.weight"].to(dtype) for p in parts]
    biases = [state.get(f"{parent}.{p}.bias") for p in parts]
    bias = None if biases[0] is None else torch.cat(biases).to(dtype)
    return weights, bias


def reference(layer, name: str, state: dict, stats: torch.Tensor, scheme: str) -> QuantLinear:
    """The built-in engine's smoothed `QuantLinear` for the same weights, statistics and exponent."""
    dtype = layer.flashrl_params_dtype
    weights, bias = checkpoint_shards(name, state, dtype)
    ref = QuantLinear(
        weights[0].shape[1],
        sum(w.shape[0] for w in weights),
        scheme,
        bias=bias is not None,
        shard_sizes=[w.shape[0] for w in weights],
        dtype=dtype,
    )
    enable_smoothing_(ref)
    ref.act_amax.copy_(stats)
    assert refresh_(ref, weights, ALPHA)
    ref.requantize_(torch.cat(weights))
    if bias is not None:
        ref.bias.copy_(bias)
    return ref


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def probe_input(stats: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Six rows shaped like the layer's activations: uniform in +-(the window's max |x|) per channel."""
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(6, stats.numel(), generator=gen) * 2 - 1) * stats).to(dtype)


def check_layer(layer, name: str, state: dict, stats: torch.Tensor, scheme: str, what: str):
    """The layer after a refresh: it used `stats`, opened a new window, and its factors, codes and
    scales are those of the built-in `QuantLinear` bit for bit; its output is that of its operands
    (float64) and stands for the new weight. Returns the factors."""
    st = vsmoothing.layer_smoothing(layer)
    ref = reference(layer, name, state, stats, scheme)
    assert torch.equal(st.act_stat, stats), f"{what}/{name}: refreshed from another window"
    assert not bool(st.act_amax.any()), f"{what}/{name}: no new statistics window"
    assert torch.equal(st.smooth, ref.smooth), f"{what}/{name}: factors differ from QuantLinear's"
    assert same_bits(layer.weight.data, ref.weight), f"{what}/{name}: codes differ"
    assert same_bits(layer.weight_scale.data, ref.weight_scale), f"{what}/{name}: scales differ"
    assert same_bits(getattr(layer, "row_scale", None), ref.row_scale), f"{what}/{name}: rows"
    x = probe_input(stats, layer.flashrl_params_dtype)
    y = layer.quant_method.apply(layer, x, getattr(layer, "bias", None))
    y_ref = ref(x)
    if layer.flashrl_kernel_id < 0:  # flashrl's op: the built-in forward, bit for bit
        assert torch.equal(y, y_ref), f"{what}/{name}: output differs from QuantLinear's"
    else:
        assert rel_err(y, y_ref) < KERNEL_TOL, f"{what}/{name}: vLLM kernel output"
    st.act_amax.zero_()  # the probe is not a rollout
    bias = 0.0 if ref.bias is None else ref.bias.double()
    w_codes = ref.layout.dequantize(ref.weight, ref.weight_scale, ref.row_scale, torch.float64)
    xs = x.float() / st.smooth
    if layer.flashrl_kernel_id >= 0:  # a vLLM kernel takes x / s in the model dtype
        xs = xs.to(x.dtype).float()
    exact = dequantized_input(xs, scheme) @ w_codes.t() + bias
    assert rel_err(y, exact) < EXACT_TOL, f"{what}/{name}: output vs its own operands"
    w_new = torch.cat(checkpoint_shards(name, state, torch.float64)[0])
    assert rel_err(y, x.double() @ w_new.t() + bias) < WEIGHT_TOL, f"{what}/{name}: vs new W"
    return st.smooth.clone()


def dequantized_input(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """`x` quantized with the scheme's activation granularity and dequantized, in float64."""
    xq, sx = quantize_activation(x, get_scheme(scheme))
    m, k = xq.shape
    groups = sx.shape[-1] if sx.dim() == 2 else 1
    scale = sx.double().reshape(-1, groups, 1) if sx.dim() else sx.double()
    return (xq.double().reshape(m, groups, k // groups) * scale).reshape(m, k)


# ------------------------------------------------------------------------------- (a) bit for bit


@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
def test_layers_equal_the_builtin_quantlinear_after_an_update(checkpoints, scheme):
    with engine(checkpoints["a"], scheme) as llm:
        up = WeightUpdater(llm)
        layers = smoothed(llm)
        assert len(layers) == 8  # qkv, o, gate_up, down in two decoder layers
        assert all(torch.equal(s, torch.ones_like(s)) for s in factors(llm).values())  # s = 1
        generate(llm)
        stats = windows(llm)
        assert all(bool(s.any()) for s in stats.values()), "the forward gathered no statistics"
        up.update_weights(checkpoints["b_sd"].items())
        for name, layer in layers.items():
            s = check_layer(layer, name, checkpoints["b_sd"], stats[name], scheme, scheme)
            assert not torch.equal(s, torch.ones_like(s))


# ----------------------------------------------------------------- (b) every load path refreshes


def per_tensor(llm, state: dict) -> None:
    """TRL colocate / OpenRLHF: one tensor per ``load_weights`` call, in a random order."""
    items = list(state.items())
    random.Random(0).shuffle(items)
    model = model_of(llm)
    for item in items:
        model.load_weights([item])
    llm.reset_prefix_cache()


def one_list(llm, state: dict) -> None:
    """verl: every tensor in one ``load_weights`` call."""
    model_of(llm).load_weights(list(state.items()))
    llm.reset_prefix_cache()


def reload_iterator(llm, state: dict) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
    llm.reset_prefix_cache()


LOAD_PATHS = ("update_weights", "reload_weights(iterator)", "reload_weights(disk)", "TRL", "verl")


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_every_load_path_refreshes_the_factors(checkpoints, scheme):
    """Each path in turn (alternating the weights a / b): the factors change, come from the window
    the rollouts gathered and the new weights, and the output matches its float64 references."""
    with engine(checkpoints["a"], scheme) as llm:
        up = WeightUpdater(llm)
        which = "b"
        for step, path in enumerate(LOAD_PATHS):
            generate(llm, seed=step)
            stats, before = windows(llm), factors(llm)
            state = checkpoints[f"{which}_sd"]
            if path == "update_weights":
                up.update_weights(state.items())
            elif path == "reload_weights(iterator)":
                reload_iterator(llm, state)
            elif path == "reload_weights(disk)":
                llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": str(checkpoints[which])}
                )
                llm.reset_prefix_cache()
            else:
                (per_tensor if path == "TRL" else one_list)(llm, state)
            for name, layer in smoothed(llm).items():
                s = check_layer(layer, name, state, stats[name], scheme, path)
                assert not torch.equal(s, before[name]), f"{path}/{name}: factors not refreshed"
            which = "a" if which == "b" else "b"


# --------------------------------------------------------------- (c) fresh factors beat stale ones


def prompt_logprobs(llm, seqs: list[list[int]]) -> torch.Tensor:
    """The logprob of every token of `seqs` after its prefix (a prefill with prompt logprobs)."""
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
    return torch.tensor(
        [
            step[token].logprob
            for out in outs
            for step, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])
        ],
        dtype=torch.float64,
    )


def test_fresh_factors_beat_factors_frozen_at_step_0(checkpoints, monkeypatch):
    """Factors frozen after the first update (as an offline calibration would be) against factors
    refreshed at every sync, once an update has moved the outlier channel from 3 to 40; mean
    |delta logprob| of every token of fp32-reference rollouts, all engines in fp32."""
    with (
        engine(checkpoints["a"], dtype="float32") as fresh,
        engine(checkpoints["a"], dtype="float32") as stale,
        engine(checkpoints["b"], "bf16", dtype="float32") as ref,
    ):
        updaters = {"fresh": WeightUpdater(fresh), "stale": WeightUpdater(stale)}
        for name, llm in (("fresh", fresh), ("stale", stale)):
            generate(llm)
            updaters[name].update_weights(checkpoints["a_sd"].items())  # factors for a
        frozen = factors(stale)
        for name, llm in (("fresh", fresh), ("stale", stale)):
            with monkeypatch.context() as patch:
                if name == "stale":
                    patch.setattr(vsmoothing, "refresh_", lambda *args: False)
                for seed in (1, 2):  # the first refresh after the move still sees a's statistics
                    updaters[name].update_weights(checkpoints["b_sd"].items())
                    generate(llm, seed=seed)
        assert all(torch.equal(s, frozen[n]) for n, s in factors(stale).items())
        assert not any(torch.equal(s, frozen[n]) for n, s in factors(fresh).items())
        seqs = generate(ref, seed=3)
        truth = prompt_logprobs(ref, seqs)
        err = {
            name: float((prompt_logprobs(llm, seqs) - truth).abs().mean())
            for name, llm in (("fresh", fresh), ("stale", stale))
        }
    print(f"mean |delta logprob| vs fp32: {err}")
    assert err["fresh"] < 0.7 * err["stale"], err


# ------------------------------------------------------- (d) shard by shard: never mixed factors


def probe(layer) -> torch.Tensor:
    """The layer's output on a fixed input, leaving its statistics window as it was."""
    st = vsmoothing.layer_smoothing(layer)
    window = st.act_amax.clone()
    x = probe_input(torch.full_like(window, 4.0), layer.flashrl_params_dtype, seed=7)
    y = layer.quant_method.apply(layer, x, getattr(layer, "bias", None))
    st.act_amax.copy_(window)
    return y


def layer_bits(layer) -> list[torch.Tensor]:
    st = vsmoothing.layer_smoothing(layer)
    return [t.clone() for t in (st.smooth, layer.weight.data, layer.weight_scale.data)]


def test_fused_layer_loaded_shard_by_shard_never_mixes_factors(checkpoints):
    """TRL sends q, k and v (gate and up) in separate calls, with rollouts in between: the layer
    keeps its old factors and codes, whole, until the last shard arrives, then encodes every shard
    with one new s computed from all of them (the built-in `QuantLinear`, bit for bit)."""
    from flashrl.vllm_backend.direct_load import load_stats

    with engine(checkpoints["a"]) as llm:
        WeightUpdater(llm)
        generate(llm)
        model, new = model_of(llm), checkpoints["b_sd"]
        layers = smoothed(llm)
        for fused, parts in (("self_attn.qkv_proj", PARTS["qkv_proj"]),
                             ("mlp.gate_up_proj", PARTS["gate_up_proj"])):  # fmt: skip
            name = f"model.layers.0.{fused}"
            layer, prefix = layers[name], name.rpartition(".")[0]
            old_bits, old_out = layer_bits(layer), probe(layer)
            for step, part in enumerate(parts[:-1]):
                for kind in ("weight", "bias"):
                    if f"{prefix}.{part}.{kind}" in new:
                        model.load_weights(
                            [(f"{prefix}.{part}.{kind}", new[f"{prefix}.{part}.{kind}"])]
                        )
                assert load_stats(model)["pending_layers"] >= 1
                generate(llm, seed=10 + step)  # rollouts while the group is incomplete
                assert all(torch.equal(a, b) for a, b in zip(layer_bits(layer), old_bits)), part
                assert torch.equal(probe(layer), old_out), f"{name}: changed after {part} only"
            stats = vsmoothing.layer_smoothing(layer).act_amax.clone()
            for kind in ("bias", "weight"):
                key = f"{prefix}.{parts[-1]}.{kind}"
                if key in new:
                    model.load_weights([(key, new[key])])
            # Refreshed once, from the window including the rollouts above, with every shard.
            check_layer(layer, name, new, stats, "int8", f"{name} shard by shard")
            assert not torch.equal(vsmoothing.layer_smoothing(layer).smooth, old_bits[0])
        assert load_stats(model)["pending_layers"] == 0


def test_a_refused_weight_leaves_factors_and_statistics_as_they_were(checkpoints):
    """vLLM's reload quantizes a layer whose new weight holds a NaN: the quantizer refuses it
    (`WeightError` naming the layer) after the refresh, which is undone: s and the statistics
    window are those of the old weights. (The codes stay; the scales a failed reload overwrote are
    undefined with or without smoothing, docs/reliability.md: update again.)"""
    with engine(checkpoints["a"]) as llm:
        WeightUpdater(llm)
        generate(llm)
        layer = smoothed(llm)["model.layers.0.self_attn.qkv_proj"]
        st = vsmoothing.layer_smoothing(layer)
        # The storages the forward reads (vLLM's reload swaps meta stand-ins in while it runs).
        kept = [st.smooth, layer.weight.data]
        before, window = [t.clone() for t in kept], st.act_amax.clone()
        bad = dict(checkpoints["b_sd"])
        q = "model.layers.0.self_attn.q_proj.weight"
        bad[q] = bad[q].clone()
        bad[q][1, 2] = float("nan")
        with pytest.raises(WeightError, match=r"layers\.0\.self_attn\.qkv_proj"):
            reload_iterator(llm, {k: v for k, v in bad.items() if ".layers.0.self_attn." in k})
        assert [torch.equal(a, b) for a, b in zip(kept, before)] == [True, True]
        assert torch.equal(st.act_amax, window) and st.refreshes == 0


# ----------------------------------------------------------- config: accepted, refused where not


def test_quant_config_carries_smooth_and_refuses_bad_values():
    from flashrl.vllm_backend.quant_config import FlashRLInt8Config

    kwargs = engine_kwargs(RolloutConfig(quant="int8", smooth=0.5))
    config = FlashRLInt8Config.from_config(kwargs["hf_overrides"]["quantization_config"])
    assert config.smooth == 0.5 and "smooth=0.5" in repr(config)
    assert FlashRLInt8Config.from_config({"quant_method": "flashrl_int8"}).smooth is None
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(
            ConfigError, match=r"smooth=.* flashrl_int8 .* allowed: a number in \(0, 1\]"
        ):
            FlashRLInt8Config.from_config({"quant_method": "flashrl_int8", "smooth": bad})
    with pytest.raises(ValueError, match="allowed: skip, smooth"):
        FlashRLInt8Config.from_config({"quant_method": "flashrl_int8", "alpha": 0.5})


def test_moe_experts_are_refused_by_name_unless_skipped(tmp_path):
    from flashrl.vllm_backend.testing import save_tiny_moe_model

    path = save_tiny_moe_model(tmp_path / "moe", family="qwen3_moe")
    with pytest.raises(Exception, match=r"smooth=0.5 is not supported for MoE experts \(model\.layers\.\d+\.mlp\.experts\)") as info:  # fmt: skip
        with engine(path):
            pass
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, ConfigError) for e in chain), chain
    config = RolloutConfig(quant="int8", smooth=0.5, skip=["lm_head", "*.mlp.gate", "*.experts"])
    llm = vllm.LLM(str(path), **engine_kwargs(config), dtype="bfloat16", **LLM_ARGS)
    try:  # experts in high precision: the dense layers are smoothed
        assert len(smoothed(llm)) > 0
        generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        gc.collect()


# ------------------------------------------- first step: VLLMBackend calibrates; logprobs exact


def test_vllm_backend_calibrates_on_its_first_generate_and_logprobs_stay_exact(checkpoints):
    """As the built-in engine: the first generate gathers statistics on its prompts and reloads the
    checkpoint with fresh factors (the built-in QuantLinear's, bit for bit) before sampling. The
    logprobs vLLM reports are those of the distribution it sampled from: at T = 1 they equal a
    prefill rescoring of the same tokens (fp32 engine; bounds as tests/test_vllm_logprobs.py's)."""
    from flashrl.core.sampling import SamplingParams
    from flashrl.vllm_backend import VLLMBackend

    config = RolloutConfig(quant="int8", smooth=ALPHA)
    with VLLMBackend(str(checkpoints["a"]), config, dtype="float32", **LLM_ARGS) as backend:
        layers = smoothed(backend.llm)
        assert backend.updater.smoothing_pending
        assert all(torch.equal(s, torch.ones_like(s)) for s in factors(backend.llm).values())
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=0, raw_logprobs=True)
        rollouts = backend.generate(PROMPTS, params)
        assert not backend.updater.smoothing_pending
        assert backend.stats()["smooth_calibration_s"] > 0
        for name, layer in layers.items():
            st = vsmoothing.layer_smoothing(layer)
            assert st.refreshes == 1 and not torch.equal(st.smooth, torch.ones_like(st.smooth))
            ref = reference(layer, name, checkpoints["a_sd"], st.act_stat, "int8")
            assert torch.equal(st.smooth, ref.smooth) and same_bits(layer.weight.data, ref.weight)
        delta = torch.tensor(
            [a - b for r in rollouts for a, b in zip(r.logprobs, r.raw_logprobs)]
        ).abs()
        assert len(delta) == 12 * len(PROMPTS)
        assert float(delta.max()) < 3e-2 and float(delta.mean()) < 1e-3, delta
        backend.generate(PROMPTS, params)  # calibrates once
        assert all(vsmoothing.layer_smoothing(m).refreshes == 1 for m in layers.values())


def test_compiled_engine_gathers_statistics_and_refreshes(checkpoints):
    """Without ``enforce_eager`` vLLM compiles the model (torch.compile; on CUDA also graphs): the
    custom op's in-place update of the window must survive compilation and reloads. Statistics of
    a prefill over the same prompts agree with an eager engine's to fp32 rounding (fp32 engines:
    in bf16 the two differ by bf16 rounding, up to 2%; sampled tokens may diverge, so prompts only)."""
    windows_of = {}
    for mode, kw in (("eager", {}), ("compiled", {"enforce_eager": False})):
        with engine(checkpoints["a"], dtype="float32", **kw) as llm:
            up = WeightUpdater(llm)
            llm.generate(PROMPTS, vllm.SamplingParams(max_tokens=1), use_tqdm=False)
            windows_of[mode] = stats = windows(llm)
            assert all(bool(s.any()) for s in stats.values()), f"{mode}: no statistics gathered"
            up.update_weights(checkpoints["b_sd"].items())
            for name, layer in smoothed(llm).items():
                check_layer(layer, name, checkpoints["b_sd"], stats[name], "int8", mode)
            generate(llm, seed=5)  # after the reload, the same storages are written
            assert all(bool(s.any()) for s in windows(llm).values()), f"{mode}: after update"
    for name, s in windows_of["eager"].items():
        assert rel_err(windows_of["compiled"][name], s) < 1e-4, name
