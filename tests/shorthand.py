"""Test shorthand, test conveniences only (not library API): `TrainConfig` fields by their bare
names (``steps=3`` for ``run.steps``), and an `Engine` built from loose field keywords
(`build_engine`), which `Engine` itself refuses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flashrl.core.config import RolloutConfig, resolve_config
from flashrl.core.env import from_env
from flashrl.engine import Engine, EngineConfig
from flashrl.rl.config import field_names


def dotted(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every bare field name under its dotted name (bare names are unique across the
    groups; ``model`` and dotted names pass through). Not flashrl 0.1's flat names: ``quant`` for
    ``rollout.quant``, ``path`` for ``data.path``."""
    where = {name.rpartition(".")[2]: name for name in field_names()}
    return {where.get(key, key): value for key, value in values.items()}


ROLLOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(RolloutConfig))


def build_engine(
    model_dir: str | Path,
    rollout_config: str | Path | RolloutConfig | None = None,
    engine_config: EngineConfig | None = None,
    **fields: Any,
) -> Engine:
    """`Engine(model_dir, rollout_config, engine_config)` with `fields` split between the two: a
    `RolloutConfig` field replaces it in `rollout_config` (resolved as the engine resolves it:
    None is FLASHRL_CONFIG, else the defaults), any other name goes in the `EngineConfig`. For
    tests that vary a few settings over many engines; tests of `Engine`'s own arguments call
    `Engine`."""
    rollout = {k: v for k, v in fields.items() if k in ROLLOUT_FIELDS}
    engine = {k: v for k, v in fields.items() if k not in ROLLOUT_FIELDS}
    if rollout:
        base = resolve_config(rollout_config) if rollout_config is not None else from_env()
        rollout_config = dataclasses.replace(base or RolloutConfig(), **rollout)
    if engine:
        engine_config = dataclasses.replace(engine_config or EngineConfig(), **engine)
    return Engine(model_dir, rollout_config, engine_config)
