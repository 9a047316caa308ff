"""vLLM backend with an FP8 KV cache: scales calibrated by flashrl's code at start-up, on the first
prompts and after every update (vLLM resets hand-set scales to 1.0 on each reload).

One in-process fp8-KV `VLLMBackend` and one bf16-KV reference engine (tiny sharp Qwen3, head_dim 32
as vLLM's CPU attention wants, ``enforce_eager``). Accuracy is the mean |prompt logprob difference|
to the bf16-KV engine over 4 x 39 tokens (vLLM's prefill reads the fp8 cache). Measured on 2 cores:
0.114 with calibrated scales on the base weights, 0.113 after an update that multiplies K and V by
256 (Q and o_proj by 1/256: the same function); with the scales of before the update (stale) 1.86,
with vLLM's 1.0 (what a reload leaves when nobody re-applies them) 0.67. The last test repeats
the essentials in a fresh process (FLASHRL_CONFIG hook, compiled model, multiprocess engine, file
transport).
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()  # in-process engines, 1 GiB KV cache, no FLASHRL_CONFIG from the caller

from vllm.inputs import TokensPrompt  # noqa: E402

from cpu_flags import NO_AVX512_AMX, has_avx512_or_amx  # noqa: E402
from flashrl.core.config import RolloutConfig  # noqa: E402
from flashrl.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from flashrl.model.config import ModelConfig  # noqa: E402
from flashrl.model.kv_calibration import (  # noqa: E402
    calibrate_from_weights,
    checkpoint_getter,
    fallback_sequences,
)
from flashrl.vllm_backend import VLLMBackend, WeightUpdater, engine_kwargs  # noqa: E402
from flashrl.vllm_backend.testing import load_state_dict, save_tiny_vllm_model  # noqa: E402

LLM_ARGS = dict(enforce_eager=True, max_model_len=128, max_num_seqs=8)
FP8_KV = RolloutConfig(kv_cache_dtype="fp8")
needs_fp8_kv_cache = pytest.mark.skipif(not has_avx512_or_amx(), reason=NO_AVX512_AMX)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = save_tiny_vllm_model(
        tmp_path_factory.mktemp("vllm_kv") / "base", family="qwen3", seed=0, initializer_range=0.2
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (40,), generator=gen).tolist() for _ in range(4)]
    reference = vllm.LLM(str(path), dtype="bfloat16", seed=0, **LLM_ARGS, **engine_kwargs("bf16"))
    backend = VLLMBackend(path, FP8_KV, **LLM_ARGS)
    yield {
        "path": path,
        "state": load_state_dict(path),
        "prompts": prompts,
        "reference": reference,
        "backend": backend,
    }
    backend.close()
    reference.llm_engine.engine_core.shutdown()
    gc.collect()


def prompt_logprobs(llm, prompts) -> torch.Tensor:
    params = vllm.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return torch.cat(
        [
            torch.tensor(
                [step[t].logprob for step, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            )
            for o in outs
        ]
    )


def scales(llm) -> dict[str, torch.Tensor]:
    layers = llm.collective_rpc("flashrl_kv_scales")[0]
    assert all(x["k"] == x["k_float"] and x["v"] == x["v_float"] for x in layers), (
        "device and host scales differ"
    )
    return {name: torch.tensor([x[name] for x in layers]) for name in ("k", "v", "q")}


def scale_kv(state: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """K and V `factor` times larger, Q and o_proj `factor` times smaller: the same function (Qwen3:
    K and Q through the q/k norm weights)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("k_norm.weight") or ".v_proj." in name:
            tensor = tensor * factor
        elif name.endswith(("q_norm.weight", "o_proj.weight")):
            tensor = tensor / factor
        out[name] = tensor
    return out


def test_engine_kwargs_for_fp8_kv():
    kwargs = engine_kwargs(FP8_KV)
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["additional_config"] == {
        "flashrl_kv_scale": "calibrated"
    }
    fixed = engine_kwargs(RolloutConfig(kv_cache_dtype="fp8", kv_scale=0.05))
    assert fixed["additional_config"] == {"flashrl_kv_scale": 0.05}
    assert "additional_config" not in engine_kwargs("int8")
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match="fp8_per_token_head KV cache, which vLLM 0.32 runs only in CUDA"
        ):
            engine_kwargs(RolloutConfig(kv_cache_dtype="fp8", kv_scale="dynamic"))


@needs_fp8_kv_cache
def test_start_up_and_first_prompts_calibrate_like_the_builtin_engine(setup):
    """At start-up the scales come from the checkpoint and random token ids; the first generate
    recalibrates on its prompts. Both equal flashrl's own calibration of the same weights (one
    function for both backends)."""
    backend, path = setup["backend"], setup["path"]
    config = ModelConfig.from_model_dir(path)
    expected = calibrate_from_weights(
        checkpoint_getter(path), config, fallback_sequences(config.vocab_size), include_q=True
    )
    start = scales(backend.llm)
    assert torch.equal(start["k"], expected.k[:, 0]) and torch.equal(start["v"], expected.v[:, 0])
    assert torch.equal(start["q"], expected.q)
    assert backend.updater.kv.from_fallback and backend.stats()["kv_calibration_s"] > 0
    prompts = setup["prompts"][:2]
    backend.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=0, ignore_eos=True)
    )
    assert not backend.updater.kv.from_fallback
    engine = Engine(
        path,
        RolloutConfig(kv_cache_dtype="fp8"),
        EngineConfig(dtype="bf16", device="cpu", progress=False, max_len=128),
    )
    engine.calibrate_kv(prompts)
    assert torch.equal(scales(backend.llm)["k"], engine.kv_scales.k[:, 0])
    assert torch.equal(scales(backend.llm)["v"], engine.kv_scales.v[:, 0])
    recent = (
        backend.updater.kv.recent.sequences()
    )  # prompt + response, one sample of each prompt first
    assert (
        [s[:40] for s in recent[:2]] == prompts
        and all(len(s) == 48 for s in recent)
        and len(recent) == 4
    )


@needs_fp8_kv_cache
def test_update_that_scales_kv_recalibrates_and_stays_accurate(setup):
    sync, llm = setup["backend"].updater, setup["backend"].llm
    prompts, state = setup["prompts"], setup["state"]
    reference = prompt_logprobs(setup["reference"], prompts)
    calibration = prompts[:2]

    sync.update_weights(state.items(), kv_sequences=calibration)
    before = scales(llm)
    error = (prompt_logprobs(llm, prompts) - reference).abs().mean()
    assert error < 0.2

    timings = sync.update_weights(scale_kv(state, 256.0).items(), kv_sequences=calibration)
    assert timings["kv_calibration_s"] > 0
    after = scales(llm)
    assert torch.equal(after["k"], 256 * before["k"]) and torch.equal(after["v"], 256 * before["v"])
    assert torch.equal(after["q"], before["q"] / 256)
    fresh = (prompt_logprobs(llm, prompts) - reference).abs().mean()
    assert fresh < 1.5 * error, f"fresh scales: {fresh:.3f} vs {error:.3f} before the update"

    # what recalibration prevents: the old scales clip K and V, vLLM's reset value 1.0 clips K
    for k, v in ((before["k"].tolist(), before["v"].tolist()), (1.0, 1.0)):
        llm.collective_rpc("flashrl_set_kv_scales", args=(k, v, None))
        llm.reset_prefix_cache()
        assert (prompt_logprobs(llm, prompts) - reference).abs().mean() > 3 * fresh
    sync.update_weights(
        state.items(), kv_sequences=calibration
    )  # leave the base weights and their scales


@needs_fp8_kv_cache
def test_update_recalibrates_on_remembered_rollouts_and_refuses_partial_updates(setup):
    backend, sync = setup["backend"], setup["backend"].updater
    outs = backend.generate(
        setup["prompts"][2:], SamplingParams(temperature=1.0, max_tokens=6, seed=1, ignore_eos=True)
    )
    timings = backend.update_weights(setup["state"].items())
    assert (
        timings["kv_calibration_s"] > 0
        and backend.stats()["kv_calibration_s"] > timings["kv_calibration_s"]
    )
    recent = sync.kv.recent.sequences()
    assert recent[: len(outs)] == [o.prompt_ids + o.response_ids for o in outs]  # newest first
    assert sync.kv.scales.tokens == sum(map(len, recent))
    version = sync.version
    with pytest.raises(ValueError, match="this update lacks model.embed_tokens.weight"):
        sync.update_weights(
            [
                (
                    "model.layers.0.mlp.down_proj.weight",
                    setup["state"]["model.layers.0.mlp.down_proj.weight"],
                )
            ]
        )
    assert sync.version == version, "nothing may be sent when the update is refused"
    with pytest.raises(ValueError, match="calibrate_kv reads the checkpoint on disk"):
        sync.calibrate_kv(setup["prompts"])


@needs_fp8_kv_cache
def test_fixed_kv_scale_is_reapplied_after_every_update(setup):
    llm = setup["backend"].llm
    fixed = WeightUpdater(llm, kv_scale=0.05)
    assert torch.all(scales(llm)["k"] == torch.tensor(0.05)) and torch.all(
        scales(llm)["v"] == torch.tensor(0.05)
    )
    timings = fixed.update_weights(setup["state"].items())
    assert timings["kv_calibration_s"] >= 0 and torch.all(scales(llm)["k"] == torch.tensor(0.05))
    with pytest.raises(ValueError, match="kv_scale=0.1 needs an engine with kv_cache_dtype='fp8'"):
        WeightUpdater(setup["reference"], kv_scale=0.1)
    with pytest.raises(ValueError, match="kv_scale='auto' is invalid"):
        WeightUpdater(llm, kv_scale="auto")
    setup["backend"].updater.update_weights(
        setup["state"].items()
    )  # calibrated scales again for later tests


@needs_fp8_kv_cache
def test_flashrl_config_fp8_kv_in_a_fresh_multiprocess_engine(setup, tmp_path):
    """``FLASHRL_CONFIG`` with int8 weights and an fp8 KV cache on a plain ``LLM(model)`` (compiled
    model, engine core in its own process): the hook builds the fp8 cache, `WeightUpdater` sets
    calibrated scales at start-up and after an update sent through files, and the compiled model
    follows scale changes."""
    from test_vllm_processes import run_script

    config = RolloutConfig(quant="int8", kv_cache_dtype="fp8").to_yaml(tmp_path / "flashrl.yaml")
    result = run_script(
        tmp_path,
        f"""
        import json
        from vllm import LLM, SamplingParams
        from flashrl.vllm_backend import WeightUpdater
        from flashrl.vllm_backend.testing import load_state_dict

        def greedy(llm):
            params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            return [list(o.outputs[0].token_ids) for o in llm.generate(["Hello world", "abc"], params, use_tqdm=False)]

        if __name__ == "__main__":
            llm = LLM({str(setup["path"])!r}, max_model_len=128, max_num_seqs=8)
            sync = WeightUpdater(llm)
            start = llm.collective_rpc("flashrl_kv_scales")[0]
            timings = sync.update_weights(load_state_dict({str(setup["path"])!r}).items())
            calibrated = greedy(llm)
            llm.collective_rpc("flashrl_set_kv_scales", args=(1e-4, 1e-4, None))
            llm.reset_prefix_cache()
            print("RESULT " + json.dumps({{
                "cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,
                "quantization": llm.llm_engine.vllm_config.model_config.quantization,
                "start": start, "after": llm.collective_rpc("flashrl_kv_scales")[0],
                "transport": sync.transport, "kv_calibration_s": timings["kv_calibration_s"],
                "follows_scales": greedy(llm) != calibrated,
            }}))
    """,
        env={"FLASHRL_CONFIG": str(config), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert result["cache_dtype"] == "fp8" and result["quantization"] == "flashrl_int8"
    assert result["transport"] == "file" and result["kv_calibration_s"] > 0
    assert all(0.001 < layer["k"] < 0.1 and 0.001 < layer["v"] < 0.1 for layer in result["start"])
    assert all(abs(layer["k"] - 1e-4) < 1e-9 for layer in result["after"])
    assert result["follows_scales"], "the compiled model must read the scales set after compilation"
