"""Run directories written before the stats schema (old metrics.jsonl keys) read in today's names,
values unchanged; today's names follow the unit rules of docs/architecture.md ("Stats keys")."""

import json

from flashrl.rl.checkpoint import read_metrics
from flashrl.rl.metric_names import RENAMED, new_key, upgrade_row
from flashrl.rl.run import summarize

OLD_ROW = {  # the keys a tiny `flashrl train` wrote before the schema, with workers and delta
    "step": 0,
    "reward/mean": 0.5,
    "time/rollout": 0.11,
    "time/reward": 0.001,
    "time/logprobs": 0.07,
    "time/train": 0.2,
    "time/sync_total": 0.013,
    "time/sync": 0.0003,
    "time/requant": 0.0107,
    "time/kv_calibration": 0.0,
    "time/sync/worker0": 0.012,
    "time/sync/worker1": 0.011,
    "time/step": 0.4,
    "sync/bytes_sent": 123456.0,
    "sync/codes_changed_frac": 0.25,
    "sync/delta_full": 1.0,
    "sync/delta_repaired": 0.0,
    "throughput/rollout_tokens_per_s": 2598.5,
    "memory/peak_gib": 0.49,
}
NEW_ROW = {
    "step": 0,
    "reward/mean": 0.5,
    "time/rollout_s": 0.11,
    "time/reward_s": 0.001,
    "time/logprobs_s": 0.07,
    "time/train_s": 0.2,
    "time/weight_update_s": 0.013,
    "time/transfer_s": 0.0003,
    "time/requantize_s": 0.0107,
    "time/kv_calibration_s": 0.0,
    "time/worker0/weight_update_s": 0.012,
    "time/worker1/weight_update_s": 0.011,
    "time/step_s": 0.4,
    "weight_update/sent_bytes": 123456.0,
    "weight_update/codes_changed_frac": 0.25,
    "weight_update/delta_full": 1.0,
    "weight_update/delta_repaired": 0.0,
    "throughput/rollout_tokens_per_s": 2598.5,
    "memory/peak_gib": 0.49,
}


def test_old_keys_read_as_new_with_the_same_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    later = {**NEW_ROW, "step": 1}  # a run resumed by today's code: old rows, then new ones
    path.write_text(json.dumps(OLD_ROW) + "\n" + json.dumps(later) + "\n")
    rows = read_metrics(path)
    assert rows == [NEW_ROW, later]
    assert list(rows[0]) == list(NEW_ROW)  # order kept too


def test_new_keys_are_left_alone():
    assert upgrade_row(NEW_ROW) == NEW_ROW
    assert all(new_key(k) == k for k in NEW_ROW)
    assert new_key("rollout_corr/kl") == "rollout_corr/kl"  # verl's names are not ours to change


def test_renamed_keys_carry_their_unit():
    for old, new in RENAMED.items():
        assert new.startswith("time/") == new.endswith("_s"), (old, new)
    assert not any(k.startswith(("sync/", "time/sync")) for k in NEW_ROW)


def test_the_summary_of_an_old_run_equals_that_of_a_new_one(tmp_path):
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text(json.dumps(OLD_ROW) + "\n")
    new.write_text(json.dumps(NEW_ROW) + "\n")
    summary = summarize("x", read_metrics(old))
    assert json.dumps(summary) == json.dumps(summarize("x", read_metrics(new)))  # nan == nan
    assert summary["transfer_s"] == 0.0003 and summary["requantize_s"] == 0.0107
