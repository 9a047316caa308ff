"""Online SmoothQuant for one quantized linear layer: per-input-channel factors that follow the weights.

SmoothQuant (Xiao et al., 2023) computes ``x W^T`` as ``(x / s) (W * s)^T`` with, per input
channel k, ``s_k = max|x_k|^a / max_n |W_nk|^(1-a)``: outlier activation channels shrink, the weight
columns they meet grow, and both quantize with less error (on SmolLM2-135M, int8's sampled KL
drops about 3x at a = 0.5; benchmarks/RESULTS.md). Offline recipes calibrate s once and freeze
it; here s is recomputed at every weight update (`refresh_`) from

- the activation statistics gathered in the forward since the previous refresh (a running max of
  |x| per input channel: one extra reduction per layer call, `observe_and_scale`), and
- the incoming weight's column maxima over all shards of a fused layer (q, k and v meet one x),

so the factors follow the weights as training moves them. s is applied as an explicit fp32 scale
on the activation before it is quantized (one elementwise pass; not folded into the preceding
RMSNorm or v/up rows, which would round s into bf16 parameters). The engine samples from what it
computes, so its logprobs stay exact for the distribution it samples from.

Buffers a smoothed layer carries (fp32, [in_features]): ``smooth`` (s, ones until the first
refresh with statistics), ``act_amax`` (the running max of the current window) and ``act_stat``
(the statistics of the last refresh, reused when no forward ran in between).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

SMOOTH_RANGE = (1e-4, 1e4)
"""Bounds on a factor: a dead channel (max|x| = 0) or a zero weight column must not give 0 or inf."""
STAT_FLOOR = 1e-5
"""Floor on max|x| and max|W| before the powers (SmoothQuant's own clamp)."""


def smoothing_buffers(in_features: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The three fp32 [in_features] tensors of a smoothed layer: ``smooth`` (ones), ``act_amax``
    and ``act_stat`` (zeros). The vLLM plugin keeps them outside vLLM's view of the layer."""
    return {
        "smooth": torch.ones(in_features, dtype=torch.float32, device=device),
        "act_amax": torch.zeros(in_features, dtype=torch.float32, device=device),
        "act_stat": torch.zeros(in_features, dtype=torch.float32, device=device),
    }


def enable_smoothing_(layer: nn.Module) -> None:
    """Give `layer` (a `QuantLinear`) the smoothing buffers; s = 1 until `refresh_` has statistics.

    Call before the weights are loaded: codes are always encoded as ``W * s`` with the current s."""
    for name, tensor in smoothing_buffers(layer.in_features, layer.weight.device).items():
        layer.register_buffer(name, tensor)


def observe_and_scale(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Fold this call's per-channel max|x| into ``act_amax`` (in place: CUDA-graph safe) and return
    ``x / s`` in fp32, the input the quantizer sees."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0]:
        torch.maximum(layer.act_amax, flat.detach().abs().amax(0).float(), out=layer.act_amax)
    return x.float() / layer.smooth


def smoothing_factors(
    act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float
) -> torch.Tensor:
    """SmoothQuant's ``s = max|x|^a / max|W|^(1-a)`` per input channel, clamped to `SMOOTH_RANGE`;
    channels that never saw a nonzero activation keep s = 1."""
    act = act_amax.float().clamp_min(STAT_FLOOR)
    wgt = weight_amax.float().clamp_min(STAT_FLOOR)
    s = (act.pow(alpha) / wgt.pow(1.0 - alpha)).clamp_(*SMOOTH_RANGE)
    return torch.where(act_amax > 0, s, torch.ones_like(s))


@torch.no_grad()
def refresh_(layer: nn.Module, shard_weights: Sequence[torch.Tensor], alpha: float) -> bool:
    """Recompute ``layer.smooth`` from the activation statistics and the new weight of every shard
    (all of them: every shard's codes are re-encoded with the new s right after). Starts a new
    statistics window. Returns False, leaving s as it was, when no activation was ever observed."""
    if bool(layer.act_amax.amax() > 0):
        layer.act_stat.copy_(layer.act_amax)
        layer.act_amax.zero_()
    if not bool(layer.act_stat.amax() > 0):
        return False
    weight_amax = torch.stack(
        [w.to(layer.smooth.device).abs().amax(0).float() for w in shard_weights]
    ).amax(0)
    layer.smooth.copy_(smoothing_factors(layer.act_stat, weight_amax, alpha))
    return True
