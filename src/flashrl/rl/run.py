"""Entry points behind `flashrl train`: one run, or a comparison of rollout precisions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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
    """'bf16,int8,int8-notis' -> [(name, overrides)], '-notis' meaning tis_cap 0."""
    from flashrl.quant.schemes import get_scheme

    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        no_tis = item.endswith("-notis")
        scheme = item[: -len("-notis")] if no_tis else item
        overrides: dict = dict(rollout_quant=get_scheme(scheme).name)
        if no_tis:
            overrides["tis_cap"] = 0.0
        out.append((item, overrides))
    if not out:
        raise ValueError("--compare needs at least one scheme")
    return out


def run(config: TrainConfig) -> list[dict]:
    """`flashrl train`: one run, or with `config.compare` one run per precision (same seed and data)
    under output_dir/<name>, a side-by-side plot and a summary table. Returns the summary rows."""
    if not config.compare:
        _, summary = train_once(config)
        rows = [summary]
    else:
        root = Path(config.output_dir)
        runs, rows = {}, []
        for name, overrides in compare_variants(config.compare):
            sub = dataclasses.replace(config, compare=None, output_dir=str(root / name), **overrides)
            metrics, summary = train_once(sub, name)
            runs[name] = metrics
            rows.append(summary)
        root.mkdir(parents=True, exist_ok=True)
        if config.plot:
            plot_runs(runs, root / "compare.png")
        (root / "compare.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows, SUMMARY_COLUMNS))
    return rows
