"""Entry points behind `flashrl train`: one run, or a comparison of rollout precisions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flashrl.errors import ConfigError
from flashrl.rl.config import TrainConfig
from flashrl.rl.plot import TIME_PARTS, plot_runs
from flashrl.utils import format_table


def summarize(name: str, metrics: list[dict], window: int = 5) -> dict:
    """First/last-window mean reward, mean mismatch KL and the mean time split of a run."""
    if not metrics:
        return dict(run=name, steps=0)
    first, last = metrics[:window], metrics[-window:]

    def mean(rows, key):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    row = dict(run=name, steps=len(metrics), reward_first=mean(first, "reward/mean"), reward_last=mean(last, "reward/mean"),
               mismatch_kl=mean(metrics, "rollout_corr/kl"), k3_kl=mean(metrics, "rollout_corr/k3_kl"),
               tok_per_s=mean(metrics, "throughput/rollout_tokens_per_s"), step_s=mean(metrics, "time/step"))
    for part in TIME_PARTS:
        row[f"{part}_s"] = mean(metrics, f"time/{part}")
    return row


SUMMARY_COLUMNS = ["run", "steps", "reward_first", "reward_last", "mismatch_kl", "k3_kl", "tok_per_s", "step_s",
                   *(f"{p}_s" for p in TIME_PARTS)]


def train_once(config: TrainConfig, name: str | None = None) -> tuple[list[dict], dict]:
    """Train with `config`; returns (metrics of every step in output_dir, summary row)."""
    from flashrl.rl.trainer import Trainer, read_metrics

    trainer = Trainer(config)
    trainer.train()
    metrics = read_metrics(trainer.metrics_path)
    if config.plot:
        plot_runs({name or config.rollout_quant: metrics}, trainer.output_dir / "curves.png")
    return metrics, summarize(name or config.rollout_quant, metrics)


def compare_variants(spec: str) -> list[tuple[str, dict]]:
    """'bf16,int8,int8-notis' -> [(name, overrides)], '-notis' meaning tis_cap 0. Each variant is one run
    directory, so a variant listed twice (also in another spelling, e.g. INT8) is a ConfigError."""
    from flashrl.quant.schemes import get_scheme

    out, seen = [], {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        no_tis = item.lower().endswith("-notis")
        scheme = item[: -len("-notis")] if no_tis else item
        try:
            name = get_scheme(scheme).name
        except ValueError as err:
            raise ConfigError(f"compare={spec!r}: {err}") from None
        key = name + ("-notis" if no_tis else "")
        if key in seen:
            raise ConfigError(f"compare={spec!r} lists {key!r} twice ({seen[key]!r} and {item!r}); each variant is "
                              f"one run directory under output_dir: list it once")
        seen[key] = item
        overrides: dict = dict(rollout_quant=name)
        if no_tis:
            overrides["tis_cap"] = 0.0
        out.append((key, overrides))
    if not out:
        raise ConfigError(f"compare={spec!r} needs at least one scheme, e.g. bf16,int8,int8-notis")
    return out


def variant_configs(config: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """The (name, config) of each run `config` asks for: itself, or one per `compare` variant under
    output_dir/<name>."""
    if not config.compare:
        return [(config.rollout_quant, config)]
    root = Path(config.output_dir)
    return [(name, dataclasses.replace(config, compare=None, output_dir=str(root / name), **overrides))
            for name, overrides in compare_variants(config.compare)]


def preflight(config: TrainConfig) -> None:
    """Checks that need no model, for every run of `config`, before the first one starts: FLASHRL_*
    variables, output directories that are files, fresh runs into a directory holding a run."""
    from flashrl.config import from_env
    from flashrl.rl.checkpoint import check_output_dir, refuse_existing_run

    from_env()  # the rollout scheme comes from the config, but a bad variable is an error as elsewhere
    check_output_dir(config.output_dir)
    for _, sub in variant_configs(config):
        out = check_output_dir(sub.output_dir)
        if not sub.resume and not sub.overwrite:
            refuse_existing_run(out, overwrite=False)


def run(config: TrainConfig) -> list[dict]:
    """`flashrl train`: one run, or with `config.compare` one run per precision (same seed and data)
    under output_dir/<name>, a side-by-side plot and a summary table. Returns the summary rows."""
    preflight(config)
    if not config.compare:
        _, summary = train_once(config)
        rows = [summary]
    else:
        root = Path(config.output_dir)
        runs, rows = {}, []
        for name, sub in variant_configs(config):
            metrics, summary = train_once(sub, name)
            runs[name] = metrics
            rows.append(summary)
        root.mkdir(parents=True, exist_ok=True)
        if config.plot:
            plot_runs(runs, root / "compare.png")
        (root / "compare.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows, SUMMARY_COLUMNS))
    return rows
