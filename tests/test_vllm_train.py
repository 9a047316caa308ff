"""`flashrl train --rollout.backend vllm`: the tiny preset runs three steps with vLLM rollouts (int8 via the
flashrl plugin, per-step weight push) and logs the mismatch metrics."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()

from flashrl.tools.cli import main  # noqa: E402


def test_three_step_vllm_training_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRL_CACHE", str(tmp_path / "cache"))  # builds the tiny model here
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--rollout.backend",
            "vllm",
            "--run.steps",
            "3",
            "--run.output-dir",
            str(out),
            "--run.plot",
            "false",
            "--rollout.backend-kwargs",
            '{"enforce_eager": true}',
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        # int8 vLLM rollouts against an fp32 trainer: a small, finite, non-zero mismatch
        assert 0 < row["rollout_corr/k3_kl"] < 0.1
        for key in (
            "rollout_corr/kl",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_probs_diff_max",
            "time/transfer_s",
        ):
            assert key in row, key
    assert (out / "checkpoint-3" / "model.safetensors").is_file()
