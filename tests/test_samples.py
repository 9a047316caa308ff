"""samples.jsonl: which rollouts are picked, what a line holds, and the trainer writing it (with the
per-sync weight-change fractions and the truncation metric in metrics.jsonl)."""

from __future__ import annotations

import json
import math

import pytest

from flashrl.core.rollout import Rollout
from flashrl.errors import ConfigError
from flashrl.rl.config_build import build_config
from flashrl.rl.samples import (
    SAMPLES_FILE,
    Sample,
    collect,
    format_samples,
    pick,
    record_samples,
)
from flashrl.rl.trainer import Trainer, read_metrics

FIELDS = {
    "step",
    "prompt",
    "response",
    "reward",
    "answer",
    "truncated",
    "response_tokens",
    "rollout_logprob_mean",
    "trainer_logprob_mean",
}


def sample(**overrides) -> Sample:
    values = dict(
        step=3,
        prompt="1+2=",
        response="3",
        reward=1.0,
        answer="3",
        truncated=False,
        response_tokens=2,
        rollout_logprob_mean=-0.25,
        trainer_logprob_mean=-0.5,
    )
    values.update(overrides)
    return Sample(**values)


# ------------------------------------------------------------------------------------ pick


@pytest.mark.parametrize(
    "num,group,count,expected",
    [
        (32, 4, 3, [0, 8, 20]),  # 8 groups, stride 8/3
        (32, 4, 2, [0, 16]),
        (16, 4, 4, [0, 4, 8, 12]),
        (16, 4, 10, [0, 4, 8, 12]),  # capped by the number of groups
        (16, 4, 0, []),
        (16, 4, -1, []),
        (3, 4, 2, []),  # not one whole group
        (8, 1, 3, [0, 2, 5]),
    ],
)
def test_pick_spreads_group_starts(num, group, count, expected):
    assert pick(num, group, count) == expected


def test_pick_gives_distinct_group_starts():
    for count in range(1, 20):
        got = pick(64, 4, count)
        assert len(got) == min(count, 16) and len(set(got)) == len(got)
        assert all(i % 4 == 0 and 0 <= i < 64 for i in got) and got == sorted(got)


# ------------------------------------------------------------------------------------ collect


def fake_rollouts(groups: int, group_size: int) -> list[Rollout]:
    out = []
    for g in range(groups):
        for k in range(group_size):
            n = g + k + 1
            out.append(
                Rollout(
                    prompt_ids=[1, 2],
                    response_ids=list(range(n)),
                    text=f"resp{g}.{k}",
                    logprobs=[-0.5 * (j + 1) for j in range(n)],
                    finish_reason="length" if g % 2 else "stop",
                    prompt_index=g,
                    sample_index=k,
                )
            )
    return out


def test_collect_fields():
    rollouts = fake_rollouts(4, 2)
    scores = [float(i) / 10 for i in range(8)]
    got = collect(
        7, ["p0", "p1", "p2", "p3"], ["a0", "a1", "a2", "a3"], rollouts, scores, {4: -1.25}, 2, 2
    )
    assert [s.step for s in got] == [7, 7]
    first, second = got
    assert (first.prompt, first.answer, first.response) == ("p0", "a0", "resp0.0")
    assert (second.prompt, second.answer, second.response) == ("p2", "a2", "resp2.0")
    assert (first.reward, second.reward) == (0.0, 0.4)
    assert (first.truncated, second.truncated) == (False, False)
    assert (first.response_tokens, second.response_tokens) == (1, 3)
    assert first.rollout_logprob_mean == -0.5
    assert second.rollout_logprob_mean == pytest.approx((-0.5 - 1.0 - 1.5) / 3)
    assert first.trainer_logprob_mean is None  # not scored by the trainer
    assert second.trainer_logprob_mean == -1.25
    odd = collect(0, ["p0", "p1"], ["a0", "a1"], fake_rollouts(2, 2), [0.0] * 4, {}, 2, 2)
    assert [s.truncated for s in odd] == [False, True]


def test_collect_empty_response_has_nan_mean():
    r = Rollout([1], [], "", [], "stop")
    (s,) = collect(0, ["p"], ["a"], [r], [0.0], {}, 1, 1)
    assert s.response_tokens == 0 and math.isnan(s.rollout_logprob_mean)


def test_sample_json_round_trip():
    s = sample(prompt="ünïcode\n2+2=", trainer_logprob_mean=None)
    line = s.to_json()
    assert "\n" not in line and "ünïcode" in line  # one line, not ASCII-escaped
    row = json.loads(line)
    assert set(row) == FIELDS
    assert Sample(**row) == s


def test_format_samples_marks_truncation_and_shortens():
    text = format_samples([sample(truncated=True, response="x" * 500), sample(step=4)], width=40)
    first, second = text.splitlines()
    assert "(truncated)" in first and "(truncated)" not in second
    assert "x" * 37 + "..." in first and "x" * 38 not in first
    assert first.startswith("  step 3 reward 1 [2 tok (truncated)]")
    assert second.startswith("  step 4 ") and "(answer 3)" in second


def test_record_samples_appends_lines(tmp_path, capsys):
    path = tmp_path / SAMPLES_FILE
    record_samples(path, [sample(step=0), sample(step=0, response="4")])
    assert capsys.readouterr().out == ""
    record_samples(path, [sample(step=1)] * 4, print_now=True)
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    assert len(printed) == 3 and all(p.startswith("  step 1 ") for p in printed)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert rows[1]["response"] == "4"
    record_samples(path, [], print_now=True)
    assert capsys.readouterr().out == "" and len(path.read_text().splitlines()) == 6


# ------------------------------------------------------------------------------------ trainer


def tiny(out, **overrides):
    """The built-in tiny model (int8 rollouts), two short steps."""
    values = {
        "run.steps": 2,
        "algo.batch_size": 16,
        "algo.group_size": 4,
        "run.micro_batch_size": 16,
        "run.output_dir": str(out),
        "run.plot": False,
        "run.log_weight_changes": True,
        "run.samples_per_step": 3,
    }
    values.update(overrides)
    return build_config("tiny-cpu", None, values)


def sample_lines(out) -> list[str]:
    return (out / SAMPLES_FILE).read_text().splitlines()


def test_trainer_writes_samples_and_change_fractions(tmp_path):
    out = tmp_path / "run"
    Trainer(tiny(out)).train()
    lines = sample_lines(out)
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1]
    for r in rows:
        assert set(r) == FIELDS
        assert "+" in r["prompt"] and r["answer"].isdigit()
        assert 1 <= r["response_tokens"] <= 6 and isinstance(r["truncated"], bool)
        assert r["reward"] in (0.0, 1.0)
        assert r["trainer_logprob_mean"] is not None
        assert abs(r["trainer_logprob_mean"] - r["rollout_logprob_mean"]) < 0.5, r
    assert len({r["prompt"] for r in rows[:3]}) == 3  # one per group, three groups
    metrics = read_metrics(out / "metrics.jsonl")
    assert len(metrics) == 2
    for m in metrics:
        for key in (
            "response/truncated_frac",
            "weight_update/weights_changed_frac",
            "weight_update/codes_changed_frac",
            "weight_update/dense_changed_frac",
        ):
            assert 0.0 <= m[key] <= 1.0, (key, m[key])
    assert any(
        m["weight_update/codes_changed_frac"] > 0 for m in metrics
    )  # lr 3e-4 moves int8 codes

    resumed = Trainer(tiny(out, **{"run.steps": 3, "run.resume": "latest"}))
    assert resumed.step == 2
    resumed.train()
    after = sample_lines(out)
    assert after[:6] == lines
    assert [json.loads(line)["step"] for line in after[6:]] == [2, 2, 2]


def test_resume_drops_sample_lines_of_steps_it_recomputes(tmp_path):
    out = tmp_path / "run"
    Trainer(tiny(out, **{"run.steps": 1, "run.log_weight_changes": False})).train()
    lines = sample_lines(out)
    stale = json.dumps({**json.loads(lines[0]), "step": 1, "prompt": "stale"})
    (out / SAMPLES_FILE).write_text("\n".join(lines + [stale]) + "\n")  # a crash after step 1
    resumed = Trainer(tiny(out, **{"run.resume": "latest", "run.log_weight_changes": False}))
    assert resumed.step == 1
    resumed.train()
    after = sample_lines(out)
    assert after[:3] == lines and len(after) == 6
    assert all(json.loads(line)["step"] == 1 and "stale" not in line for line in after[3:])


def test_no_samples_file_when_samples_per_step_is_zero(tmp_path):
    out = tmp_path / "run"
    config = tiny(out, **{"run.steps": 1, "run.samples_per_step": 0})
    Trainer(config).train()
    assert not (out / SAMPLES_FILE).exists()
    assert (out / "metrics.jsonl").is_file()


def test_sample_and_weight_change_config_errors(tmp_path):
    with pytest.raises(
        ConfigError, match=r"run.samples_per_step=-1 is invalid; allowed: an integer >= 0"
    ):
        tiny(tmp_path, **{"run.samples_per_step": -1})
    with pytest.raises(ConfigError, match="run.log_weight_changes needs the built-in engine"):
        tiny(tmp_path, **{"rollout.workers.count": 1})
