"""Curves of a run (reward, mismatch KL, step-time breakdown) and of a precision comparison, as PNG."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TIME_PARTS = ("rollout", "logprobs", "train", "transfer", "requantize")
"""The phases of the step-time split: ``time/<part>_s`` of metrics.jsonl."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'flashrl[plot]'): no plot written")
        return None
    return plt


def _series(metrics: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs = [m["step"] for m in metrics if key in m]
    return xs, [m[key] for m in metrics if key in m]


def plot_runs(runs: dict[str, list[dict]], path: str | Path) -> Path | None:
    """One figure: mean reward, mismatch KL (k3 estimator, log scale) and the mean step-time split per run."""
    plt = _pyplot()
    if plt is None or not runs:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, metrics in runs.items():
        axes[0].plot(*_series(metrics, "reward/mean"), label=name)
        xs, kl = _series(metrics, "rollout_corr/k3_kl")
        axes[1].plot(xs, [max(v, 1e-9) for v in kl], label=name)
    axes[0].set(title="mean reward", xlabel="step")
    axes[1].set(title="mismatch KL (k3, rollout vs trainer)", xlabel="step", yscale="log")
    names = list(runs)
    bottoms = [0.0] * len(names)
    for part in TIME_PARTS:
        values = []
        for name in names:
            vals = [m.get(f"time/{part}_s", 0.0) for m in runs[name]]
            values.append(sum(vals) / max(len(vals), 1))
        axes[2].bar(names, values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes[2].set(title="mean step time split (s)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
