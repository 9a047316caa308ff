"""vLLM backend: quantized layers equal `QuantLinear` bit for bit, per-step reload equals a fresh
load, `engine_kwargs` / `WeightUpdater` / `VLLMBackend` behave as documented.

Every engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on a tiny random Qwen3 checkpoint
(head_dim 32, as vLLM's CPU attention wants) with `enforce_eager=True` to keep the suite short; the
compiled and multi-process paths are covered by tests/test_vllm_processes.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()  # in-process engines, 1 GiB KV cache, no FLASHRL_CONFIG from the caller

from flashrl.core.config import RolloutConfig  # noqa: E402
from flashrl.core.rollout import BACKEND_STATS_KEYS, Rollout, RolloutBackend  # noqa: E402
from flashrl.core.sampling import SamplingParams  # noqa: E402
from flashrl.quant.linear import QuantLinear  # noqa: E402
from flashrl.vllm_backend import METHOD_NAMES, WeightUpdater, engine_kwargs  # noqa: E402
from flashrl.vllm_backend.kernels import kernel_name  # noqa: E402
from flashrl.vllm_backend.testing import load_state_dict, save_perturbed_copy, save_tiny_vllm_model  # noqa: E402
from flashrl.vllm_backend.weight_update import check_fused_complete  # noqa: E402

SCHEMES = ("bf16", "int8", "fp8", "fp8_channel", "fp8_block", "int8_g64")
QUANT_SCHEMES = SCHEMES[1:]
PROMPTS = ["Hello world", "The quick brown fox", "1+1=", "abc"]
LLM_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0, max_num_seqs=16)

# vLLM layer -> the checkpoint tensors it fuses, in order (Qwen3).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A sharp tiny model (initializer_range 0.2: logits with real spread) and a perturbed copy."""
    root = tmp_path_factory.mktemp("vllm_ckpt")
    base = save_tiny_vllm_model(root / "base", family="qwen3", seed=0, initializer_range=0.2)
    perturbed = save_perturbed_copy(base, root / "perturbed", scale=0.2, seed=1)
    return {
        "base": base,
        "perturbed": perturbed,
        "base_sd": load_state_dict(base),
        "perturbed_sd": load_state_dict(perturbed),
    }


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def model_of(llm):
    """The vLLM model object of an in-process engine."""
    return llm.apply_model(lambda model: model)[0]


def greedy_and_sampled(llm):
    """Greedy and seeded T=0.7 / top-p 0.9 samples of PROMPTS: token ids and processed logprobs."""
    results = []
    for params in (
        vllm.SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True),
        vllm.SamplingParams(
            temperature=0.7, top_p=0.9, n=2, seed=3, max_tokens=12, logprobs=0, ignore_eos=True
        ),
    ):
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            for c in out.outputs:
                results.append(
                    (list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)])
                )
    return results


def layer_tensors(llm) -> dict[str, torch.Tensor]:
    """Clones of every parameter of the decoder layers' linear layers (codes, scales)."""
    model = model_of(llm)
    return {
        name: p.detach().clone()
        for name, p in model.model.layers.named_parameters()
        if "proj" in name
    }


def expected_quantlinear(state_dict, layer: int, vllm_name: str, scheme: str) -> QuantLinear:
    """`QuantLinear.from_linear` of the fused bf16 weight (and bias) a vLLM layer receives."""
    names = [f"model.layers.{layer}.{name}" for name in FUSED[vllm_name]]
    parts = [state_dict[f"{name}.weight"].to(torch.bfloat16) for name in names]
    fused = torch.cat(parts)
    has_bias = f"{names[0]}.bias" in state_dict
    linear = torch.nn.Linear(fused.shape[1], fused.shape[0], bias=has_bias, dtype=torch.bfloat16)
    linear.weight.data.copy_(fused)
    if has_bias:
        linear.bias.data.copy_(torch.cat([state_dict[f"{name}.bias"] for name in names]))
    return QuantLinear.from_linear(linear, scheme, shard_sizes=[p.shape[0] for p in parts])


def assert_layers_match(llm, state_dict, scheme: str) -> None:
    model = model_of(llm)
    for i, decoder_layer in enumerate(model.model.layers):
        for vllm_name in FUSED:
            layer = decoder_layer.get_submodule(vllm_name)
            expected = expected_quantlinear(state_dict, i, vllm_name, scheme)
            where = f"layers.{i}.{vllm_name} ({scheme})"
            assert type(layer.quant_method).__name__ == "FlashRLLinearMethod", where
            assert torch.equal(layer.weight.view(torch.uint8), expected.weight.view(torch.uint8)), (
                f"codes differ: {where}"
            )
            assert torch.equal(layer.weight_scale, expected.weight_scale), f"scales differ: {where}"
            row_scale = getattr(layer, "row_scale", None)
            assert (row_scale is None) == (expected.row_scale is None), where
            if row_scale is not None:
                assert torch.equal(row_scale, expected.row_scale), where
            assert (layer.bias is None) == (expected.bias is None), where
            if layer.bias is not None:
                assert torch.equal(layer.bias, expected.bias), f"bias differs: {where}"
            x = torch.randn(
                7,
                layer.input_size_per_partition,
                generator=torch.Generator().manual_seed(i),
                dtype=torch.bfloat16,
            )
            y = layer.quant_method.apply(layer, x, layer.bias)
            if kernel_name(getattr(layer, "flashrl_kernel_id", -1)) == "flashrl":
                assert torch.equal(y, expected(x)), f"forward differs: {where}"
            else:  # vLLM's kernel quantizes the activations itself: same math, its own rounding
                want = expected(x).double()
                error = float((y.double() - want).norm() / want.norm())
                assert error < 2e-2, (
                    f"forward of {where} via {kernel_name(layer.flashrl_kernel_id)}: {error:.3g}"
                )


def fresh_record(llm) -> dict:
    return {"outputs": greedy_and_sampled(llm), "tensors": layer_tensors(llm)}


def assert_same_state(llm, record: dict, what: str) -> None:
    """Outputs (tokens and logprobs) and every linear-layer code and scale equal `record`, bit for bit."""
    assert greedy_and_sampled(llm) == record["outputs"], f"outputs differ from {what}"
    tensors = layer_tensors(llm)
    assert tensors.keys() == record["tensors"].keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor.view(torch.uint8), record["tensors"][name].view(torch.uint8)), (
            f"{name} vs {what}"
        )


@pytest.fixture(scope="module", params=SCHEMES)
def engine(request, checkpoints):
    """Per scheme: the record of a fresh engine started from the perturbed checkpoint (then shut
    down), and the engine under test, started from the base checkpoint, with its own fresh record."""
    scheme = request.param
    reference = vllm.LLM(str(checkpoints["perturbed"]), **LLM_ARGS, **engine_kwargs(scheme))
    perturbed_fresh = fresh_record(reference)
    shutdown(reference)
    llm = vllm.LLM(str(checkpoints["base"]), **LLM_ARGS, **engine_kwargs(scheme))
    yield {
        "scheme": scheme,
        "llm": llm,
        "sync": WeightUpdater(llm),
        "base_fresh": fresh_record(llm),
        "perturbed_fresh": perturbed_fresh,
    }
    shutdown(llm)


# ------------------------------------------------------------------------------------------------
# engines: quantized layers, reload exactness
# ------------------------------------------------------------------------------------------------


def test_layers_equal_quantlinear_bit_for_bit(engine, checkpoints):
    """Every quantized vLLM layer holds exactly the codes and scales of
    `QuantLinear.from_linear(fused, scheme, shard_sizes=...)` and computes its forward (exactly with
    flashrl's op, to rounding with vLLM's kernel: tests/test_vllm_kernels.py); embeddings and LM
    head stay unquantized."""
    scheme, llm = engine["scheme"], engine["llm"]
    model = model_of(llm)
    unquantized = "UnquantizedEmbeddingMethod" if scheme == "bf16" else "FlashRLEmbeddingMethod"
    assert type(model.model.embed_tokens.quant_method).__name__ == unquantized
    assert type(model.lm_head.quant_method).__name__ == unquantized
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16
    if scheme == "bf16":
        assert llm.llm_engine.vllm_config.model_config.quantization is None
        return
    assert llm.llm_engine.vllm_config.model_config.quantization == METHOD_NAMES[scheme]
    assert_layers_match(llm, checkpoints["base_sd"], scheme)


def test_reload_equals_fresh_engine(engine, checkpoints):
    """Push the perturbed weights into the engine started from the base checkpoint: greedy and
    seeded top-p tokens and logprobs, and every code and scale, equal those of a fresh engine
    started from the perturbed checkpoint. Pushing the base weights back restores the engine's own
    fresh load. The kernel tensors keep their storage (in-place reload); the prefix cache, filled
    with the other weights' KV in between, is not reused."""
    scheme, llm, sync = engine["scheme"], engine["llm"], engine["sync"]
    ptrs = {
        name: p.data_ptr()
        for name, p in model_of(llm).named_parameters()
        if "proj" in name or "embed_tokens" in name
    }
    assert "model.embed_tokens.weight" in ptrs

    timings = sync.update_weights(checkpoints["perturbed_sd"].items())
    assert timings["chunks"] == 2 + 2  # embeddings, 2 decoder layers, final norm
    assert timings["layers_requantized"] == (0 if scheme == "bf16" else 8)
    assert timings["requantize_s"] >= 0 and timings["transfer_s"] > 0
    assert engine["perturbed_fresh"]["outputs"] != engine["base_fresh"]["outputs"]
    assert_same_state(
        llm, engine["perturbed_fresh"], "a fresh engine from the perturbed checkpoint"
    )
    if scheme != "bf16":
        assert_layers_match(llm, checkpoints["perturbed_sd"], scheme)

    sync.update_weights(checkpoints["base_sd"].items())
    assert_same_state(llm, engine["base_fresh"], "the engine's own fresh load")
    assert {
        name: p.data_ptr()
        for name, p in model_of(llm).named_parameters()
        if "proj" in name or "embed_tokens" in name
    } == ptrs


@pytest.mark.parametrize(
    "engine", ["bf16", "int8"], indirect=True
)  # one unquantized, one quantized
def test_dummy_load_then_update_equals_fresh_engine(engine, checkpoints):
    """The RL start-up pattern: ``load_format="dummy"`` (random weights, nothing read from disk),
    then the trainer's first update. Also covers the tied LM head, whose CPU GEMM handle vLLM packs
    at load time and does not repack on reload (flashrl's transfer backend repacks it)."""
    llm = vllm.LLM(
        str(checkpoints["base"]), **LLM_ARGS, load_format="dummy", **engine_kwargs(engine["scheme"])
    )
    try:
        assert greedy_and_sampled(llm) != engine["base_fresh"]["outputs"]
        WeightUpdater(llm).update_weights(checkpoints["base_sd"].items())
        assert_same_state(llm, engine["base_fresh"], "a fresh engine from the base checkpoint")
    finally:
        shutdown(llm)


def test_qkv_bias_model_layers_and_reload(tmp_path):
    """Qwen2 (q/k/v bias; hidden 128 for head_dim 32), int8: fused biases equal QuantLinear's and
    the quantized forward adds them exactly; after an update the engine equals a fresh engine."""
    base = save_tiny_vllm_model(
        tmp_path / "base",
        family="qwen2",
        seed=0,
        initializer_range=0.2,
        hidden_size=128,
        intermediate_size=256,
    )
    perturbed = save_perturbed_copy(base, tmp_path / "perturbed", scale=0.2, seed=1)
    reference = vllm.LLM(str(perturbed), **LLM_ARGS, **engine_kwargs("int8"))
    perturbed_fresh = fresh_record(reference)
    shutdown(reference)
    llm = vllm.LLM(str(base), **LLM_ARGS, **engine_kwargs("int8"))
    try:
        assert_layers_match(llm, load_state_dict(base), "int8")
        WeightUpdater(llm).update_weights(load_state_dict(perturbed).items())
        assert_layers_match(llm, load_state_dict(perturbed), "int8")
        assert_same_state(llm, perturbed_fresh, "a fresh engine from the perturbed checkpoint")
    finally:
        shutdown(llm)


# ------------------------------------------------------------------------------------------------
# VLLMBackend
# ------------------------------------------------------------------------------------------------


def test_backend_implements_rollout_protocol(checkpoints):
    from flashrl.vllm_backend import VLLMBackend

    with VLLMBackend(
        str(checkpoints["perturbed"]),
        "int8",
        dtype=torch.bfloat16,
        seed=0,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=16,
    ) as backend:
        assert isinstance(backend, RolloutBackend)
        tokenizer = backend.llm.get_tokenizer()
        ids = tokenizer("1+1=")["input_ids"]
        params = SamplingParams(
            temperature=0.7, top_p=0.9, n=3, max_tokens=8, seed=5, raw_logprobs=True
        )
        rollouts = backend.generate(["Hello world", ids], params)
        assert len(rollouts) == 6 and all(isinstance(r, Rollout) for r in rollouts)
        assert [(r.prompt_index, r.sample_index) for r in rollouts] == [
            (p, s) for p in range(2) for s in range(3)
        ]
        assert rollouts[3].prompt_ids == ids
        for r in rollouts:
            assert len(r.logprobs) == len(r.response_ids) == len(r.raw_logprobs) >= 1
            assert r.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in r.logprobs) and all(lp <= 0 for lp in r.raw_logprobs)
            if r.finish_reason == "stop":
                assert r.response_ids[-1] == tokenizer.eos_token_id  # the stop token is included
        assert rollouts[0].logprobs != rollouts[0].raw_logprobs  # temperature 0.7: processed != raw

        greedy = backend.generate(
            ["abc"],
            SamplingParams(temperature=0, n=2, max_tokens=6, ignore_eos=True, raw_logprobs=True),
        )
        assert len(greedy) == 2 and greedy[0].response_ids == greedy[1].response_ids
        assert len(greedy[0].response_ids) == 6 and greedy[0].finish_reason == "length"
        # Greedy: processed = raw (no temperature); the raw pass (one bf16 prefill) aligns token by token.
        diff = max(abs(a - b) for a, b in zip(greedy[0].logprobs, greedy[0].raw_logprobs))
        assert diff < 0.05, (greedy[0].logprobs, greedy[0].raw_logprobs)

        timings = backend.update_weights(checkpoints["base_sd"].items())
        assert {"transfer_s", "requantize_s", "reset_cache_s", "weight_update_s"} <= timings.keys()
        assert (
            backend.generate(["abc"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[
                0
            ].response_ids
            != greedy[0].response_ids
        )
        stats = backend.stats()
        assert (
            stats["sequences"] == 9
            and stats["weight_updates"] == 1
            and stats["generated_tokens"] > 0
        )
        assert set(BACKEND_STATS_KEYS) <= stats.keys()  # the stats schema every backend fills


# ------------------------------------------------------------------------------------------------
# configuration and validation (no engine)
# ------------------------------------------------------------------------------------------------


def test_engine_kwargs_per_scheme():
    for scheme in QUANT_SCHEMES:
        kwargs = engine_kwargs(scheme)
        assert kwargs["quantization"] == f"flashrl_{scheme}"
        assert kwargs["logprobs_mode"] == "processed_logprobs"
        assert kwargs["weight_transfer_config"] == {"backend": "flashrl"}
        assert (
            kwargs["worker_extension_cls"] == "flashrl.vllm_backend.transfer.FlashRLWorkerExtension"
        )
        assert "hf_overrides" not in kwargs and "kv_cache_dtype" not in kwargs
    assert "quantization" not in engine_kwargs("bf16")
    assert engine_kwargs(RolloutConfig(logprobs_mode="raw"))["logprobs_mode"] == "raw_logprobs"


def test_engine_kwargs_reads_flashrl_config(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    monkeypatch.delenv("FLASHRL_LMHEAD_FP32", raising=False)
    assert "quantization" not in engine_kwargs()
    monkeypatch.setenv("FLASHRL_CONFIG", "fp8_block")
    assert engine_kwargs()["quantization"] == "flashrl_fp8_block"
    assert engine_kwargs("int8")["quantization"] == "flashrl_int8"  # an explicit scheme wins
    path = RolloutConfig(quant="int8", skip=("lm_head", "*.down_proj")).to_yaml(
        tmp_path / "flashrl.yaml"
    )
    monkeypatch.setenv("FLASHRL_CONFIG", str(path))
    assert engine_kwargs()["hf_overrides"] == {
        "quantization_config": {"quant_method": "flashrl_int8", "skip": ["lm_head", "*.down_proj"]}
    }


def test_engine_kwargs_rejects_what_vllm_cannot_do_and_accepts_fp8_kv():
    with pytest.raises(ValueError, match="lm_head_fp32=True is not supported by the vLLM backend"):
        engine_kwargs(RolloutConfig(quant="int8", lm_head_fp32=True))
    # fp8 KV with calibrated scales is supported: WeightUpdater recalibrates after every update (test_vllm_kv.py)
    assert engine_kwargs(RolloutConfig(kv_cache_dtype="fp8"))["kv_cache_dtype"] == "fp8"
    assert (
        engine_kwargs(RolloutConfig(kv_cache_dtype="fp8", kv_scale=1.0))["kv_cache_dtype"] == "fp8"
    )
    with pytest.raises(ValueError, match="scheme='int4' is invalid; allowed: bf16, int8"):
        engine_kwargs("int4")


def test_skip_patterns_on_fused_layers():
    from flashrl.vllm_backend.quant_config import FlashRLInt8Config

    config = FlashRLInt8Config.from_config(
        {"quant_method": "flashrl_int8", "skip": ["*.down_proj", "*.q_proj"]}
    )
    config.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    assert config.is_skipped("model.layers.0.mlp.down_proj")
    assert not config.is_skipped("model.layers.0.mlp.gate_up_proj")
    with pytest.raises(
        ValueError,
        match="match only .*q_proj.* of the tensors vLLM fuses into model.layers.0.self_attn.qkv_proj",
    ):
        config.is_skipped("model.layers.0.self_attn.qkv_proj")
    config = FlashRLInt8Config(skip=["*.q_proj", "*.k_proj", "*.v_proj"])
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert config.is_skipped("model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="unknown key"):
        FlashRLInt8Config.from_config({"quant_method": "flashrl_int8", "skipp": []})
    with pytest.raises(ValueError, match="expected 'flashrl_int8'"):
        FlashRLInt8Config.from_config({"quant_method": "flashrl_fp8"})


def test_weight_updater_refuses_partial_fused_groups():
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    check_fused_complete(names)
    with pytest.raises(
        ValueError, match=r"q_proj.weight is sent without .*k_proj.weight, .*v_proj.weight"
    ):
        check_fused_complete(["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match=r"up_proj.bias is sent without .*gate_proj.bias"):
        check_fused_complete(names + ["model.layers.0.mlp.up_proj.bias"])


def test_weight_updater_needs_the_flashrl_transfer_backend():
    class FakeLLM:
        class llm_engine:
            class vllm_config:
                weight_transfer_config = None

    with pytest.raises(ValueError, match="WeightUpdater needs 'flashrl'"):
        WeightUpdater(FakeLLM())
    with pytest.raises(ValueError, match="transport='pipe' is invalid"):
        WeightUpdater(FakeLLM(), transport="pipe")
