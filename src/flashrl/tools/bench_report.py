"""What `flashrl bench` returns and prints: one `BenchRow` per scheme, KV dtype and compile mode,
the `BenchResult` around them (JSON via `to_dict`), and the table of `format_rows`. Columns are
described in the `flashrl.tools.bench` module docstring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flashrl.utils import format_table


@dataclass(kw_only=True)
class BenchRow:
    """One row of the table: a scheme x KV dtype x compile mode, or the transformers row (which
    fills only scheme, tokens_per_s, tokens and vs_first). Unset (None) columns are left out of
    the JSON."""

    scheme: str
    kv_cache_dtype: str | None = None
    compile: str | None = None
    buckets: bool | None = None
    tokens_per_s: float
    warmup_s: float | None = None
    decode_step_ms: float | None = None
    decode_shapes: int | None = None
    ttft_s: float | None = None
    prefill_forwards: int | None = None
    decode_s: float | None = None
    decode_steps: int | None = None
    transfer_s: float | None = None
    requantize_s: float | None = None
    kv_calibration_s: float | None = None
    weight_gib: float | None = None
    kv_gib: float | None = None
    kv_bytes_per_token: int | None = None
    kv_capacity_tokens: int | None = None
    max_sequences: int | None = None
    kv_kl: float | None = None
    peak_gib: float | None = None
    tokens: int
    vs_first: float | None = None
    floor_tokens_per_s: float | None = None
    vs_floor: float | None = None
    weight_bytes: int | None = field(default=None, repr=False)
    """Weight memory in bytes (for the bandwidth floor; not a column)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "weight_bytes" and getattr(self, f.name) is not None
        }


COLUMNS = [
    "scheme",
    "kv_cache_dtype",
    "compile",
    "buckets",
    "tokens_per_s",
    "vs_first",
    "decode_step_ms",
    "decode_shapes",
    "warmup_s",
    "ttft_s",
    "transfer_s",
    "requantize_s",
    "kv_calibration_s",
    "weight_gib",
    "kv_gib",
    "max_sequences",
    "kv_kl",
    "peak_gib",
    "vs_floor",
]


def format_rows(rows: list[BenchRow], columns: list[str] = COLUMNS) -> str:
    table = [row.to_dict() for row in rows]
    return format_table(table, [c for c in columns if any(c in r for r in table)])
