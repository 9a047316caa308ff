"""Old metrics.jsonl keys -> today's, for reading run directories written before the stats schema.

Until commit 962827e ("one stats schema with units in the names", issue 25 part 6) the trainer wrote
durations without a unit (``time/rollout``), called the whole weight update ``time/sync_total``
and its transfer part ``time/sync``, and grouped the update's other numbers under ``sync/``. Runs
written then (a benchmark sweep, an old checkpoint's directory, a resumed run's first steps) still
hold those keys. `read_metrics` (`flashrl.rl.checkpoint`) passes every row through `upgrade_row`,
so a reader sees one schema (docs/architecture.md, "Stats keys") whatever wrote the file. Values
are never changed, only keys; nothing writes the old keys.
"""

from __future__ import annotations

import re
from typing import Any

RENAMED: dict[str, str] = {
    "time/rollout": "time/rollout_s",
    "time/reward": "time/reward_s",
    "time/logprobs": "time/logprobs_s",
    "time/train": "time/train_s",
    "time/step": "time/step_s",
    "time/sync_total": "time/weight_update_s",
    "time/sync": "time/transfer_s",
    "time/requant": "time/requantize_s",
    "time/kv_calibration": "time/kv_calibration_s",
    "sync/bytes_sent": "weight_update/sent_bytes",
}
"""Old key -> new key. Two families follow a rule instead: ``time/sync/worker<i>`` ->
``time/worker<i>/weight_update_s`` and every other ``sync/<name>`` (the changed fractions, the
``delta_*`` numbers) -> ``weight_update/<name>``."""

_WORKER = re.compile(r"time/sync/(worker\d+)")


def new_key(key: str) -> str:
    """Today's name of metrics.jsonl key `key` (itself when it is not an old name)."""
    if key in RENAMED:
        return RENAMED[key]
    worker = _WORKER.fullmatch(key)
    if worker:
        return f"time/{worker.group(1)}/weight_update_s"
    if key.startswith("sync/"):
        return "weight_update/" + key.removeprefix("sync/")
    return key


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with every old key renamed (`new_key`), values and order unchanged."""
    return {new_key(k): v for k, v in row.items()}
