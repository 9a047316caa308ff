"""Masked ``[batch, tokens]`` logprob tensors: input checks, reductions over the valid tokens, and
the log-ratio clamp.

Shared by the rollout correction (``flashrl.correction``) and the policy loss (``flashrl.rl.loss``);
a leaf module (torch and ``flashrl.errors`` only). Convention: the tensors handed to the reductions
are 0 (or False) on padding, which ``valid_float`` guarantees by zeroing padding first, so a masked
mean is one plain ``sum()`` and NaN on padding never reaches a result. A statistic over an empty set
(no valid token or row) is 0.0, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flashrl.errors import InputError

__all__ = [
    "LOG_RATIO_CLAMP",
    "Valid",
    "bool_mask",
    "check_shapes",
    "is_number",
    "masked_max",
    "masked_min",
    "to_floats",
    "valid_float",
]

LOG_RATIO_CLAMP = 20.0
"""verl's ``SAFETY_BOUND``: log-ratios are clamped to +-20 before ``exp``, so ratios and weights
stay in [e^-20, e^20] ~ [2.1e-9, 4.85e8]."""


def is_number(x: Any) -> bool:
    """An int or float that is not a bool and not NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def check_shapes(named: Mapping[str, torch.Tensor]) -> None:
    """The first tensor is ``[batch, tokens]`` and every other one has its shape."""
    (first_name, first), *rest = named.items()
    if first.dim() != 2:
        raise InputError(f"{first_name} must be [batch, tokens], got shape {tuple(first.shape)}")
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise InputError(
                f"shape mismatch: {first_name} has shape {tuple(first.shape)} "
                f"but {name} has shape {tuple(tensor.shape)}"
            )


def bool_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool; raises if a value is neither 0 nor 1."""
    if response_mask.dtype == torch.bool:
        return response_mask
    bad = (response_mask != 0) & (response_mask != 1)
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise InputError(
            f"response_mask must be bool or 0/1; it has {int(bad.sum())} other values, first "
            f"{response_mask[first].item()!r} at (batch {first[0]}, token {first[1]})"
        )
    return response_mask != 0


def valid_float(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``tensor`` with 0 on padding; raises if a valid token holds NaN or inf."""
    if not tensor.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    clean = torch.where(mask, tensor.to(torch.float32), 0.0)
    # A NaN or inf on a valid token makes the sum non-finite: one reduction answers "all finite?",
    # and the element-wise scan runs only to report where (a finite sum overflowing to inf finds
    # nothing and passes).
    if not torch.isfinite(clean.detach().sum()):
        bad = ~torch.isfinite(clean.detach())
        if bad.any():
            first = tuple(bad.nonzero()[0].tolist())
            raise InputError(
                f"{name} has {int(bad.sum())} non-finite values (NaN or inf) on valid tokens; "
                "first "
                f"{tensor[first].item()} at (batch {first[0]}, token {first[1]}). Padding is "
                "ignored; a NaN on a response token would make the loss NaN."
            )
    return clean


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of x where mask is True (any shape); 0 if there is none."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask.any(), torch.where(mask, x, -math.inf).amax(), 0.0)


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min of x where mask is True (any shape); 0 if there is none."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask.any(), torch.where(mask, x, math.inf).amin(), 0.0)


@dataclass
class Valid:
    """The response mask with the counts that masked reductions divide by.

    The ``[B, T]`` tensors handed to ``mean`` and ``frac`` must be 0 (or False) on padding. A masked
    mean is then one plain ``sum()``: a single pass, PyTorch's cascade summation, and no mask-sized
    temporary (at 512 x 8192 every temporary costs 16 MiB of fresh pages). ``masked_mean`` is for
    values that are not 0 there.
    """

    mask: torch.Tensor  # [B, T] bool
    maskf: torch.Tensor  # [B, T] fp32
    n: torch.Tensor  # [B] valid tokens per sequence (fp32)
    seq: torch.Tensor  # [B] bool: the sequence has a valid token
    n_tokens: torch.Tensor  # scalar, clamped to >= 1 so that empty batches give 0, not NaN
    n_seqs: torch.Tensor  # scalar, clamped to >= 1

    @classmethod
    def of(cls, mask: torch.Tensor) -> Valid:
        maskf = mask.to(torch.float32)
        n = maskf.sum(-1)
        seq = n > 0
        n_seqs = seq.count_nonzero().float().clamp_min(1.0)
        return cls(mask, maskf, n, seq, n.sum().clamp_min(1.0), n_seqs)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() / self.n_tokens

    def masked_mean(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask, x, 0.0).sum() / self.n_tokens

    def frac(self, cond: torch.Tensor) -> torch.Tensor:
        return cond.count_nonzero() / self.n_tokens

    def std(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Population std over valid tokens, given their mean (x may be anything on padding)."""
        return ((x - mean).mul_(self.maskf).square_().sum() / self.n_tokens).sqrt()

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return masked_max(x, self.mask)

    def min(self, x: torch.Tensor) -> torch.Tensor:
        return masked_min(x, self.mask)

    def sample_std(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Unbiased std over valid tokens (``torch.std``), given their mean; 0 for fewer than 2."""
        count = self.mask.count_nonzero()
        ss = (x - mean).mul_(self.maskf).square_().sum()
        return torch.where(count > 1, ss / (count - 1).clamp_min(1), 0.0).sqrt()

    # Per row ([B] values; a row without valid tokens counts as 0, verl's ``masked_mean``)

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """``[B]`` mean of each row's valid tokens (x is 0 on padding); 0 for an empty row."""
        return x.sum(-1) / self.n.clamp_min(1.0)

    # Over the rows with a valid token ("valid sequences")

    def seq_mean(self, values: torch.Tensor) -> torch.Tensor:
        return torch.where(self.seq, values, 0.0).sum() / self.n_seqs

    def seq_std(self, values: torch.Tensor) -> torch.Tensor:
        """Unbiased std over valid sequences (``torch.std``); 0 for fewer than 2."""
        count = self.seq.count_nonzero()
        ss = torch.where(self.seq, values - self.seq_mean(values), 0.0).square().sum()
        return torch.where(count > 1, ss / (count - 1).clamp_min(1), 0.0).sqrt()

    def seq_frac(self, cond: torch.Tensor) -> torch.Tensor:
        return (cond & self.seq).count_nonzero() / self.n_seqs

    def seq_max(self, values: torch.Tensor) -> torch.Tensor:
        return masked_max(values, self.seq)

    def seq_min(self, values: torch.Tensor) -> torch.Tensor:
        return masked_min(values, self.seq)

    # Over all rows, empty ones included (verl's per-sequence metrics); 0 for a batch without rows

    def rows_mean(self, values: torch.Tensor) -> torch.Tensor:
        return values.sum() / max(values.numel(), 1)

    def rows_std(self, values: torch.Tensor) -> torch.Tensor:
        """Unbiased std over all rows (``torch.std``); 0 for fewer than 2."""
        if values.numel() < 2:
            return values.new_zeros(())
        return values.std()

    def rows_frac(self, cond: torch.Tensor) -> torch.Tensor:
        return cond.count_nonzero() / max(cond.numel(), 1)

    def rows_max(self, values: torch.Tensor) -> torch.Tensor:
        return values.amax() if values.numel() else values.new_zeros(())

    def rows_min(self, values: torch.Tensor) -> torch.Tensor:
        return values.amin() if values.numel() else values.new_zeros(())


def to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Tensor scalars -> Python floats in one transfer."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    stacked = torch.stack([metrics[k].to(torch.float32) for k in keys]).tolist() if keys else []
    values = dict(zip(keys, stacked, strict=True))
    return {k: values[k] if k in values else float(v) for k, v in metrics.items()}
