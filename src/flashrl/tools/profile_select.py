"""Which flagged layers `flashrl profile` recommends keeping in bf16: decided by the end-to-end
mismatch, never by per-layer error alone.

Per-layer output error says where rounding is worst, not what it does to the model's output
distribution: on SmolLM2-135M, keeping the three q/k/v layers with the largest int8 error in bf16
raised the end-to-end KL (0.036 -> 0.051). So the flagged layers (worst output error first) are
tried one at a time: each is kept in bf16 on top of those already chosen, the exact end-to-end KL
(full vocabulary, fp64, `profile_metrics.distribution_mismatch`) is measured, and the layer is
chosen only if that KL is lower than the best so far. The recommendation therefore never raises
the KL it was measured on; every try is reported (names, KL, kept or not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm import tqdm

__all__ = ["select_skips"]


def select_skips(
    flagged: list[dict[str, Any]],
    kl_of: Callable[[list[str]], float],
    base_kl: float,
    progress: bool = True,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Forward selection over `flagged` (``names``, ``output_error``; worst first): `kl_of(names)` is
    the end-to-end KL with `names` kept in bf16 (on top of the default skip list). Returns the
    chosen names and the trace of every try: ``names``, ``output_error``, ``kl``, ``kept``."""
    chosen: list[str] = []
    best, trace = base_kl, []
    for item in tqdm(flagged, desc="profile: skip candidates", disable=not progress, leave=False):
        kl = kl_of(chosen + list(item["names"]))
        kept = kl < best
        trace.append(
            {"names": list(item["names"]), "output_error": item["output_error"], "kl": kl,
             "kept": kept}
        )  # fmt: skip
        if kept:
            chosen += list(item["names"])
            best = kl
    return chosen, trace
