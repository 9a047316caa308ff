"""benchmarks/fidelity.py, the report part only: metrics.jsonl files made by hand for 2 variants x 2
seeds (plus a partial seed), the final reward's mean and standard error and the within-2-SE verdict
checked against numbers computed by hand. No training."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark

STEPS = 20  # final window: the last 2 steps


fid = load_benchmark("fidelity")


def write_run(root: Path, variant: str, seed: int, rewards: list[float], kl: float) -> None:
    run = root / variant / f"seed{seed}"
    run.mkdir(parents=True)
    rows = []
    for step, reward in enumerate(rewards):
        row = {"step": step, "reward/mean": reward, "rollout_corr/kl": kl,
               "time/step": 3.0, "time/rollout": 1.0, "time/logprobs": 0.5, "time/train": 1.0}  # fmt: skip
        if variant == "int8":  # some metrics only some variants log
            row["sync/weights_changed_frac"] = 0.25
        rows.append(json.dumps(row))
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    # final reward = mean of the last 2 steps: fp32 0.6 and 0.8, int8 0.4 and 0.6
    write_run(tmp_path, "fp32", 0, [0.1] * 18 + [0.5, 0.7], kl=1e-8)
    write_run(tmp_path, "fp32", 1, [0.3] * 18 + [0.8, 0.8], kl=3e-8)
    write_run(tmp_path, "int8", 0, [0.2] * 18 + [0.4, 0.4], kl=1e-3)
    write_run(tmp_path, "int8", 1, [0.2] * 18 + [0.6, 0.6], kl=3e-3)
    write_run(tmp_path, "int8", 2, [0.9] * 5, kl=1.0)  # partial: not counted
    return tmp_path


def test_final_reward_mean_se_and_within_2se(sweep: Path) -> None:
    args = Namespace(out=str(sweep), preset="tiny-cpu", seeds="0,1", passthrough=[])
    report = fid.build_report(args, ["fp32", "int8"], STEPS)
    fp32, int8 = report["rows"]
    assert (fp32["variant"], fp32["seeds"], int8["seeds"]) == ("fp32", 2, 2)
    assert int8["partial"] == "seed2:5" and fp32["partial"] == ""
    # fp32: finals 0.6, 0.8 -> mean 0.7, sample std 0.1414, SE 0.1414 / sqrt(2) = 0.1
    assert fp32["final"] == pytest.approx(0.7) and fp32["se"] == pytest.approx(0.1)
    assert fp32["start"] == pytest.approx(0.2)
    # int8: finals 0.4, 0.6 -> mean 0.5, SE 0.1; |0.5 - 0.7| = 0.2 <= 2 sqrt(0.01 + 0.01) = 0.283
    assert int8["final"] == pytest.approx(0.5) and int8["se"] == pytest.approx(0.1)
    assert int8["diff_fp32"] == pytest.approx(-0.2)
    assert int8["within_2se"] is True and fp32["within_2se"] is None
    assert int8["kl"] == pytest.approx(2e-3) and int8["kl_last"] == pytest.approx(2e-3)
    assert int8["w_changed"] == pytest.approx(0.25) and math.isnan(fp32["w_changed"])
    assert math.isnan(fp32["k3"])  # absent from every step
    assert (int8["step_s"], int8["rollout_s"], int8["train_s"]) == pytest.approx((3.0, 1.0, 1.5))
    # curves: per step, over every seed that reached it (the partial one too)
    curve = report["curves"]["int8"]
    assert curve["n"][:5] == [3] * 5 and curve["n"][5:] == [2] * 15
    assert curve["reward"]["mean"][19] == pytest.approx(0.5)
    assert curve["reward"]["se"][19] == pytest.approx(0.1)


def test_outside_2se_and_missing_se() -> None:
    rows = [
        {"variant": "fp32", "final": 0.7, "se": 0.1},
        {"variant": "bf16", "final": 0.1, "se": 0.0},  # |-0.6| > 2 sqrt(0.01) = 0.2
        {"variant": "int8", "final": 0.65, "se": math.nan},  # one seed: no SE, no verdict
    ]
    fid.compare_fp32(rows)
    assert rows[1]["within_2se"] is False and rows[1]["diff_fp32"] == pytest.approx(-0.6)
    assert rows[2]["within_2se"] is None and rows[2]["diff_fp32"] == pytest.approx(-0.05)
    assert fid.stderr([0.5]) != fid.stderr([0.5])  # NaN below 2 values


def test_report_files_are_valid_json_markdown_and_png(sweep: Path, tmp_path: Path) -> None:
    args = Namespace(out=str(sweep), preset="tiny-cpu", seeds="0,1", passthrough=[],
                     json=str(tmp_path / "r/f.json"), md=str(tmp_path / "r/f.md"),
                     png=str(tmp_path / "r/f.png"))  # fmt: skip
    fid.write_report(args, fid.build_report(args, ["fp32", "int8"], STEPS))
    data = json.loads((tmp_path / "r/f.json").read_text(), parse_constant=pytest.fail)
    assert [r["variant"] for r in data["rows"]] == ["fp32", "int8"]
    assert data["rows"][0]["w_changed"] is None  # NaN written as null
    assert "| int8" in (tmp_path / "r/f.md").read_text()
    assert (tmp_path / "r/f.png").read_bytes()[:4] == b"\x89PNG"
