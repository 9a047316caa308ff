"""Entry points behind `flashrl train`: one run, or a comparison of rollout precisions."""

from __future__ import annotations

import json
from pathlib import Path

from flashrl.core.env import from_env
from flashrl.rl.checkpoint import check_output_dir, read_metrics, refuse_existing_run
from flashrl.rl.config import TrainConfig, compare_variants
from flashrl.rl.plot import TIME_PARTS, plot_runs
from flashrl.rl.trainer import Trainer
from flashrl.utils import format_table


def summarize(name: str, metrics: list[dict], window: int = 5) -> dict:
    """First/last-window mean reward, mean mismatch KL and the mean time split of a run."""
    if not metrics:
        return dict(run=name, steps=0)
    first, last = metrics[:window], metrics[-window:]

    def mean(rows, key):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    row = dict(
        run=name,
        steps=len(metrics),
        reward_first=mean(first, "reward/mean"),
        reward_last=mean(last, "reward/mean"),
        mismatch_kl=mean(metrics, "rollout_corr/kl"),
        k3_kl=mean(metrics, "rollout_corr/k3_kl"),
        truncated=mean(metrics, "response/truncated_frac"),
        resp_len=mean(metrics, "response/length_mean"),
        tok_per_s=mean(metrics, "throughput/rollout_tokens_per_s"),
        step_s=mean(metrics, "time/step_s"),
    )
    for part in TIME_PARTS:
        row[f"{part}_s"] = mean(metrics, f"time/{part}_s")
    return row


SUMMARY_COLUMNS = [
    "run",
    "steps",
    "reward_first",
    "reward_last",
    "mismatch_kl",
    "k3_kl",
    "truncated",
    "resp_len",
    "tok_per_s",
    "step_s",
    *(f"{p}_s" for p in TIME_PARTS),
]


def train_once(config: TrainConfig, name: str | None = None) -> tuple[list[dict], dict]:
    """Train with `config`; returns (metrics of every step in output_dir, summary row)."""
    trainer = Trainer(config)
    trainer.train()
    metrics = read_metrics(trainer.metrics_path)
    name = name or config.rollout.quant
    if config.run.plot:
        plot_runs({name: metrics}, trainer.output_dir / "curves.png")
    return metrics, summarize(name, metrics)


def variant_configs(config: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """The (name, config) of each run `config` asks for: itself, or one per `run.compare` variant
    under output_dir/<name>. A '-notis' variant turns a TIS weight off (token_tis, seq_tis) and
    leaves other weights as they are, as ``tis_cap: 0`` did."""
    if not config.run.compare:
        return [(config.rollout.quant, config)]
    root = Path(config.run.output_dir)
    out = []
    for name, overrides in compare_variants(config.run.compare):
        if config.correction.weight not in ("token_tis", "seq_tis"):
            overrides.pop("correction.weight", None)
        overrides.update({"run.compare": None, "run.output_dir": str(root / name)})
        out.append((name, config.replace(overrides)))
    return out


def preflight(config: TrainConfig) -> None:
    """Checks that need no model, for every run of `config`, before the first one starts: FLASHRL_*
    variables, output directories that are files, fresh runs into a directory holding a run."""
    from_env()  # the scheme comes from the config, but a bad variable is an error as elsewhere
    check_output_dir(config.run.output_dir)
    for _, sub in variant_configs(config):
        out = check_output_dir(sub.run.output_dir)
        if not sub.run.resume and not sub.run.overwrite:
            refuse_existing_run(out, overwrite=False)


def run(config: TrainConfig) -> list[dict]:
    """`flashrl train`: one run, or with `run.compare` one run per precision (same seed and data)
    under output_dir/<name>, a side-by-side plot and a summary table. Returns the summary rows."""
    preflight(config)
    if not config.run.compare:
        _, summary = train_once(config)
        rows = [summary]
    else:
        root = Path(config.run.output_dir)
        runs, rows = {}, []
        for name, sub in variant_configs(config):
            metrics, summary = train_once(sub, name)
            runs[name] = metrics
            rows.append(summary)
        root.mkdir(parents=True, exist_ok=True)
        if config.run.plot:
            plot_runs(runs, root / "compare.png")
        (root / "compare.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows, SUMMARY_COLUMNS))
    return rows
