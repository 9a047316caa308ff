"""Online smoothing over the whole decoder (``rollout.smooth: a``): which layers, when their factors
are refreshed, and the calibration before the first rollout. Per-layer math:
`flashrl.quant.smoothing`; measurements and the choice of a: docs/real-model.md.

- Every `QuantLinear` is smoothed (layers kept in high precision need no smoothing; MoE experts
  are refused upstream).
- A weight update refreshes the factors of every smoothed layer all of whose shards it carries,
  before writing them: a fused layer that gets only q (not k and v) keeps its factors, because its
  other shards' codes were encoded with them.
- After loading a checkpoint no activation has been seen: the first `generate` (or the first call
  that reads the KV cache: `cached_logits`, fp8-cache `score`) runs a forward over its prompts, then
  re-reads the checkpoint (file by file) with fresh factors. A weight update before that makes the
  calibration moot (the update refreshes on the next one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from flashrl.model.decoder import Decoder
from flashrl.model.weights import IGNORED, WeightMap, iter_checkpoint_files
from flashrl.quant.linear import QuantLinear
from flashrl.quant.smoothing import enable_smoothing_, refresh_

CALIBRATION_PROMPTS = 32
"""Prompts of the first generate that the first calibration forwards (one at a time, no cache)."""


class SmoothingState:
    """The smoothing exponent of one engine and whether the first calibration is still to come."""

    def __init__(self, alpha: float | None) -> None:
        self.alpha = alpha
        self.pending = False
        self.refreshed_layers = 0
        """Layers whose factors the last update (or calibration) recomputed."""

    @property
    def enabled(self) -> bool:
        return self.alpha is not None

    def enable(self, model: Decoder) -> None:
        """Give every quantized linear layer of `model` its smoothing buffers (before loading)."""
        if self.enabled:
            for module in model.modules():
                if isinstance(module, QuantLinear):
                    enable_smoothing_(module)

    @torch.no_grad()
    def refresh(self, weights: WeightMap, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Recompute the factors of the smoothed layers that `items` (a validated update) fully
        covers; call before writing `items`."""
        if not self.enabled:
            return
        self.pending = False
        shards: dict[str, dict[int | None, torch.Tensor]] = {}
        for name, tensor in items:
            for target in weights.resolve(name):
                module = weights.modules[target.module]
                if target.kind == "weight" and getattr(module, "smooth", None) is not None:
                    shards.setdefault(target.module, {})[target.shard] = tensor
        refreshed = 0
        for module_name, got in shards.items():
            layer = weights.modules[module_name]
            need = list(range(len(layer.shard_sizes))) if len(layer.shard_sizes) > 1 else [None]
            if all(i in got for i in need):
                refreshed += refresh_(layer, [got[i] for i in need], self.alpha)
        self.refreshed_layers = refreshed

    @torch.no_grad()
    def calibrate_if_pending(
        self,
        model: Decoder,
        weights: WeightMap,
        prompts: Sequence[Sequence[int]],
        model_dir: Path,
        device: torch.device,
    ) -> None:
        """The first calibration: a forward over `prompts` (statistics), then the checkpoint again,
        encoded with fresh factors."""
        if not self.pending:
            return
        for ids in prompts[:CALIBRATION_PROMPTS]:
            model(torch.tensor(list(ids), dtype=torch.long, device=device).reshape(1, -1))
        for _, group in itertools.groupby(iter_checkpoint_files(model_dir), key=lambda t: t[0]):
            items = [(name, t) for _, name, t in group if not IGNORED.match(name)]
            self.refresh(weights, items)
            weights.update(items, device)
        self.pending = False
