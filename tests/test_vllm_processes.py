"""vLLM backend in fresh processes, as users run it: the ``vllm.general_plugins`` entry point
registers flashrl's methods in every vLLM process (multiprocessing mode, compiled model), and
``FLASHRL_CONFIG`` switches an unmodified ``LLM(model)`` script to flashrl rollouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.core.config import RolloutConfig  # noqa: E402
from flashrl.vllm_backend.testing import save_perturbed_copy, save_tiny_vllm_model  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_proc_ckpt")
    base = save_tiny_vllm_model(root / "base", family="qwen3", seed=0, initializer_range=0.2)
    return {
        "base": base,
        "perturbed": save_perturbed_copy(base, root / "perturbed", scale=0.2, seed=1),
    }


def run_script(tmp_path, source: str, env: dict[str, str], timeout: int = 400) -> dict:
    """Run `source` in a fresh interpreter with `env` added; return the JSON it prints after RESULT."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "VLLM_"))}
    full_env.update({"VLLM_CPU_KVCACHE_SPACE": "1", **env})
    proc = subprocess.run(
        [sys.executable, str(script)], env=full_env, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"script failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


def test_entry_point_is_declared():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("flashrl") == "flashrl.vllm_backend.plugin:register"


def test_plugin_registers_methods_in_fresh_multiprocess_engine(checkpoints, tmp_path):
    """A fresh process: ``LLM(model, quantization="flashrl_int8")`` with vLLM's defaults (engine core
    in its own process, model compiled) generates text. The methods reach the engine process only
    through the entry point, and the config class must pickle."""
    result = run_script(
        tmp_path,
        f"""
        import json
        from vllm import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM({str(checkpoints["base"])!r}, quantization="flashrl_int8", max_model_len=128, max_num_seqs=8)
            out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            print("RESULT " + json.dumps({{"text": out[0].outputs[0].text, "ids": list(out[0].outputs[0].token_ids),
                                          "quantization": llm.llm_engine.vllm_config.model_config.quantization}}))
    """,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert result["quantization"] == "flashrl_int8"
    assert len(result["ids"]) == 8 and result["text"]


def test_flashrl_config_switches_unmodified_script(checkpoints, tmp_path):
    """``FLASHRL_CONFIG=flashrl.yaml`` (int8, down_proj kept in bf16) on a script that calls plain
    ``LLM(model)``: the hook fills in flashrl's engine arguments; `WeightUpdater` then reloads the
    multi-process engine through files, and sending the original weights back restores its
    fresh-load outputs exactly."""
    config = RolloutConfig(quant="int8", skip=("lm_head", "*.down_proj")).to_yaml(
        tmp_path / "flashrl.yaml"
    )
    result = run_script(
        tmp_path,
        f"""
        import json
        from vllm import LLM, SamplingParams
        from flashrl.vllm_backend import WeightUpdater
        from flashrl.vllm_backend.testing import load_state_dict

        def greedy(llm):
            params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
            outs = llm.generate(["Hello world", "abc"], params, use_tqdm=False)
            return [[list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]]
                    for o in outs for c in o.outputs]

        if __name__ == "__main__":
            llm = LLM({str(checkpoints["perturbed"])!r}, enforce_eager=True, max_model_len=128, max_num_seqs=8)
            cfg = llm.llm_engine.vllm_config
            fresh = greedy(llm)
            sync = WeightUpdater(llm)
            base_timings = sync.update_weights(load_state_dict({str(checkpoints["base"])!r}).items())
            base = greedy(llm)
            sync.update_weights(load_state_dict({str(checkpoints["perturbed"])!r}).items())
            print("RESULT " + json.dumps({{
                "quantization": cfg.model_config.quantization,
                "logprobs_mode": cfg.model_config.logprobs_mode,
                "transfer_backend": cfg.weight_transfer_config.backend,
                "methods": llm.collective_rpc("flashrl_linear_methods")[0],
                "transport": sync.transport,
                "layers_requantized": base_timings["layers_requantized"],
                "base_differs": base != fresh,
                "restored": greedy(llm) == fresh,
            }}))
    """,
        env={"FLASHRL_CONFIG": str(config), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert result["quantization"] == "flashrl_int8"
    assert result["logprobs_mode"] == "processed_logprobs"
    assert result["transfer_backend"] == "flashrl"
    assert result["methods"] == {
        f"model.layers.{i}.{name}": "FlashRLDenseLinearMethod"
        if name == "mlp.down_proj"
        else "FlashRLLinearMethod"
        for i in range(2)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert result["transport"] == "file"
    assert result["layers_requantized"] == 6  # 3 quantized linear layers x 2 decoder layers
    assert result["base_differs"] and result["restored"]


def test_no_hook_without_flashrl_config(monkeypatch):
    """Without FLASHRL_CONFIG the plugin leaves vLLM's classes untouched."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from flashrl.vllm_backend.plugin import ENV_HOOK_MARKER

    if os.environ.get("FLASHRL_CONFIG"):
        pytest.skip("FLASHRL_CONFIG is set in this test process")
    load_general_plugins()
    assert not getattr(EngineArgs.create_engine_config, ENV_HOOK_MARKER, False)
    assert "flashrl_int8" in vllm.model_executor.layers.quantization.QUANTIZATION_METHODS
