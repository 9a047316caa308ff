"""Online smoothing (``rollout.smooth: a``) in flashrl's vLLM linear method: the per-layer math of
the built-in engine (`flashrl.quant.smoothing`, the very same functions), mapped onto vLLM's layers
and load paths.

- **Layers**: every flashrl-quantized `LinearBase` (q/k/v and gate/up fused, as vLLM fuses them);
  layers kept in high precision need none. MoE experts are refused (`flashrl.vllm_backend.quant_config`).
- **State** (`LayerSmoothing`, fp32 [K]): ``smooth`` (s), ``act_amax`` (the running max |x| per input
  channel of the current window), ``act_stat`` (the last window's). A plain attribute of the layer
  (``layer.flashrl_smoothing``), not registered tensors: vLLM's layerwise reload deletes and
  re-creates a layer's registered parameters and buffers. These storages never move, so compiled
  code and captured CUDA graphs keep reading and writing the same memory.
- **Forward** (`flashrl_smoothed_linear`, one custom op declared as mutating ``act_amax``):
  `observe_and_scale` folds this call's max|x| into the window in place (one extra reduction) and
  divides x by s in fp32, then the GEMM runs. flashrl's op gets x / s in fp32, exactly as
  `QuantLinear.forward` passes it; a vLLM kernel gets it in the model dtype (the kernels take the
  model dtype: one bf16 rounding before the kernel's own 8-bit quantization of the activation).
- **Refresh** (`requantize`): every quantization of a smoothed layer first recomputes s with
  `refresh_` from the window's statistics and the whole incoming weight (the column maxima over all
  shards of a fused layer), then encodes W * s. Every vLLM load path quantizes a layer only once
  all of its shards are there, so shards are never encoded with different factors:
  vLLM's first load (no statistics yet: s = 1), vLLM's layerwise reload (`WeightUpdater`, the
  ``flashrl`` transfer backend, ``reload_weights``: a layer is processed when all its elements have
  arrived), and direct ``load_weights`` calls (TRL's one tensor per call, verl's one list: shards are
  staged until the layer's group is complete, `flashrl.vllm_backend.direct_load`). A layer an update
  does not reach keeps its factors, codes and window. If quantizing fails (a NaN reaching vLLM's
  reload: direct loads refuse it on arrival), s and the statistics are put back.
- **Windows**: vLLM's start-up forwards (memory profiling, warm-up, graph capture) run on dummy
  token ids; `reset_statistics` (worker method ``flashrl_reset_smoothing_stats``, called by
  `WeightUpdater` when it is built) drops what they left. An engine driven only by direct
  ``load_weights`` (TRL) keeps them in its first window.
- **First step**: s = 1 (unsmoothed) until a refresh has statistics. `VLLMBackend` calibrates on its
  first ``generate`` as the built-in engine does (`WeightUpdater.calibrate_smoothing`: a prefill
  over the prompts, then the checkpoint reloaded from disk with fresh factors); a plain ``LLM``
  runs its first step unsmoothed and smooths from its first weight update on.
- **Tensor parallelism**: each rank computes its factors from its own slice (its rows of a
  column-parallel layer, its input channels of a row-parallel one): consistent on every rank, not
  identical to TP=1. Only TP=1 is tested.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashrl.quant.dispatch import scaled_linear
from flashrl.quant.linear import QuantLinear
from flashrl.quant.schemes import get_scheme
from flashrl.quant.smoothing import observe_and_scale, refresh_, smoothing_buffers
from flashrl.vllm_backend import kernels

STATE_ATTR = "flashrl_smoothing"
"""The attribute of a smoothed vLLM layer holding its `LayerSmoothing`."""


class LayerSmoothing:
    """The smoothing tensors of one vLLM layer (see the module docstring) and its exponent."""

    def __init__(self, in_features: int, device: torch.device, alpha: float) -> None:
        buffers = smoothing_buffers(in_features, device)
        self.smooth = buffers["smooth"]
        self.act_amax = buffers["act_amax"]
        self.act_stat = buffers["act_stat"]
        self.alpha = alpha
        self.refreshes = 0
        """Refreshes that recomputed s from statistics (a diagnostic)."""

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of s and the statistics (3 x K floats), for `restore`."""
        return self.smooth.clone(), self.act_amax.clone(), self.act_stat.clone()

    def restore(self, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Put back what `snapshot` copied, in place."""
        for tensor, old in zip((self.smooth, self.act_amax, self.act_stat), saved):
            tensor.copy_(old)


def layer_smoothing(layer: torch.nn.Module) -> LayerSmoothing | None:
    """The smoothing state of `layer`, None when it is not smoothed."""
    return getattr(layer, STATE_ATTR, None)


def attach(layer: torch.nn.Module, alpha: float | None) -> LayerSmoothing | None:
    """Give `layer` (quantized, its weight materialized) its smoothing state with s = 1, once;
    None when `alpha` is None (smoothing off)."""
    if alpha is None:
        return None
    state = layer_smoothing(layer)
    if state is None:
        state = LayerSmoothing(layer.input_size_per_partition, layer.weight.device, alpha)
        setattr(layer, STATE_ATTR, state)
    return state


@torch.no_grad()
def requantize(layer: torch.nn.Module, view: QuantLinear, weight: torch.Tensor) -> None:
    """``view.requantize_(weight)`` for `layer`'s complete checkpoint-format `weight`; for a smoothed
    layer, first refresh s from the window's statistics and every shard of `weight` (vLLM's
    ``logical_widths``), then encode W * s. On failure s and the statistics are put back."""
    state = layer_smoothing(layer)
    if state is None:
        view.requantize_(weight)
        return
    saved = state.snapshot()
    try:
        refreshed = refresh_(state, list(weight.split(list(layer.logical_widths))), state.alpha)
        view.smooth = state.smooth
        view.requantize_(weight)
    except BaseException:
        state.restore(saved)
        raise
    state.refreshes += int(refreshed)


def reset_statistics(model: torch.nn.Module) -> int:
    """Start a new statistics window in every smoothed layer of `model` (drop what the forwards
    since the last refresh gathered, e.g. vLLM's start-up dummy runs); returns how many layers."""
    count = 0
    for module in model.modules():
        state = layer_smoothing(module)
        if state is not None:
            state.act_amax.zero_()
            count += 1
    return count


@torch.library.custom_op("flashrl::vllm_smoothed_linear", mutates_args=("act_amax",))
def flashrl_smoothed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    smooth: torch.Tensor,
    act_amax: torch.Tensor,
    scheme: str,
    shard_sizes: list[int],
    kernel_id: int,
) -> torch.Tensor:
    """``(x / s) @ dequant(weight)^T + bias`` in x's dtype, folding max|x| per input channel into
    `act_amax` in place; the GEMM as in ``flashrl::vllm_scaled_linear``."""
    xs = observe_and_scale(SimpleNamespace(smooth=smooth, act_amax=act_amax), x)
    if kernel_id >= 0:
        return kernels.run_kernel(kernel_id, xs.to(x.dtype), bias)
    return scaled_linear(xs, weight, scale, get_scheme(scheme), bias, x.dtype, tuple(shard_sizes))


@flashrl_smoothed_linear.register_fake
def _(x, weight, scale, bias, smooth, act_amax, scheme, shard_sizes, kernel_id):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
