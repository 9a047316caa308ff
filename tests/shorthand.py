"""Test shorthand: `TrainConfig` fields by their bare names (``steps=3`` for ``run.steps``)."""

from __future__ import annotations

from typing import Any

from flashrl.rl.config import field_names


def dotted(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every bare field name under its dotted name (bare names are unique across the
    groups; ``model`` and dotted names pass through). Not flashrl 0.1's flat names: ``quant`` for
    ``rollout.quant``, ``path`` for ``data.path``."""
    where = {name.rpartition(".")[2]: name for name in field_names()}
    return {where.get(key, key): value for key, value in values.items()}
