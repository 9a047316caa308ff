"""Rollout correction: importance weights, rejection masks and mismatch metrics.

The rollout engine and the trainer assign different probabilities to the same sampled tokens, even
with identical BF16 weights (kernels, parallelism and reduction order differ), and quantized
rollouts widen the gap: "on-policy" RL is silently off-policy (Yao et al., "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training", 2025; verl PR #2953). This package measures
the gap and corrects for it with importance sampling (IS) and rejection, as pure functions on
``[batch, tokens]`` fp32 tensors without Python loops over tokens. The formulas follow verl
``verl/trainer/ppo/rollout_corr_helper.py``; ``docs/correction.md`` has every formula, default and
metric, and a compatibility table with verl.

Modules, along the data path: ``options`` (names, defaults, parsers), ``config``
(``CorrectionConfig`` and its presets), ``ratios`` (the log-ratio), ``weights`` (IS weights,
rejection masks, batch normalization), ``metrics`` (mismatch and weight statistics), ``compute``
(``compute_correction``). The PPO-clip loss that applies the weights lives one layer up, in
``flashrl.rl.loss`` (with its aggregations), and is imported from there.
"""

from flashrl.correction.compute import Correction, compute_correction, mismatch_metrics
from flashrl.correction.config import PRESETS, CorrectionConfig
from flashrl.correction.options import (
    DEFAULT_REJECTION_THRESHOLDS,
    ICEPOP_BAND,
    MODES,
    REJECTION_OPTIONS,
    WEIGHTS,
)
from flashrl.masked import LOG_RATIO_CLAMP

__all__ = [
    "DEFAULT_REJECTION_THRESHOLDS",
    "ICEPOP_BAND",
    "LOG_RATIO_CLAMP",
    "MODES",
    "PRESETS",
    "REJECTION_OPTIONS",
    "WEIGHTS",
    "Correction",
    "CorrectionConfig",
    "compute_correction",
    "mismatch_metrics",
]
