"""The log-ratio ``delta = lp_train - lp_roll`` and what weights, rejection and metrics derive from
it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashrl.masked import Valid

__all__ = ["LogRatio"]


@dataclass
class LogRatio:
    """Everything derived from ``delta = lp_train - lp_roll`` that several steps share; token
    tensors are 0 on padding."""

    valid: Valid
    delta: torch.Tensor  # [B, T] unclamped log-ratio
    ell: torch.Tensor  # [B, T] clamped log-ratio
    rho_m1: torch.Tensor  # [B, T] expm1(ell) = rho - 1 (keeps precision near rho = 1)
    seq_delta: torch.Tensor  # [B] S_i, the unclamped masked sum of delta
    seq_ell: torch.Tensor  # [B] clamp(S_i)

    @classmethod
    def build(
        cls, lp_train: torch.Tensor, lp_roll: torch.Tensor, valid: Valid, bound: float
    ) -> LogRatio:
        delta = lp_train - lp_roll  # both are 0 on padding
        ell = delta.clamp(-bound, bound)
        seq_delta = delta.sum(-1)
        return cls(valid, delta, ell, torch.expm1(ell), seq_delta, seq_delta.clamp(-bound, bound))

    @functools.cached_property
    def k3(self) -> torch.Tensor:
        """``[B, T]`` ``rho - 1 - ell`` (k3 of the clamped log-ratio), shared by metrics and
        rejection."""
        return self.rho_m1 - self.ell

    def k3_sum_unclamped(self) -> torch.Tensor:
        """Sum of ``exp(delta) - 1 - delta`` over valid tokens, unclamped. ``expm1`` is several
        times slower than ``exp`` on CPU, so only the tokens the clamp changed (normally none) are
        redone."""
        total = self.k3.sum()
        clamped = self.delta != self.ell
        if clamped.any():
            d, e = self.delta[clamped], self.ell[clamped]
            total = total + (torch.expm1(d).sub_(d) - torch.expm1(e).sub_(e)).sum()
        return total
