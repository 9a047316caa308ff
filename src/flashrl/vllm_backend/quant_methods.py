"""flashrl's online quantization methods for vLLM: ``flashrl_int8``, ``flashrl_fp8``,
``flashrl_fp8_channel``, ``flashrl_fp8_block`` and the int8 group schemes ``flashrl_int8_g128`` /
``flashrl_int8_g64``.

Each config makes vLLM create the ordinary bf16 (checkpoint-format) weight of every linear layer,
on the meta device like vLLM's own online methods, so loading is layer by layer. When a layer's
weights are complete, `process_weights_after_loading` quantizes them with flashrl's own code: the
layer's fused weight is handed to `QuantLinear.requantize_` with ``shard_sizes`` set to vLLM's
``output_partition_sizes`` (q/k/v or gate/up), so codes and scales are exactly those of
``QuantLinear.from_linear(fused, scheme, shard_sizes=...)`` (per-tensor fp8 keeps one scale per
shard; blocks get one grid per shard). The forward pass calls `flashrl.quant.dispatch.scaled_linear`,
the function `QuantLinear.forward` calls, so a vLLM layer and a `QuantLinear` agree bit for bit.

Per-step reload uses vLLM's layerwise reload (`vllm/model_executor/model_loader/reload`): it puts
the bf16 weight back on the meta device, buffers the new checkpoint tensors until a layer is
complete, runs `process_weights_after_loading` again and copies the results into the original
storages. The method keeps no state between loads, so a reload gives exactly what a fresh load of
the same weights gives.

Kernels: ``torch._int_mm`` (int8) and ``torch._scaled_mm`` (fp8 per-tensor and per-channel) on CPU
and CUDA; fp8_block runs flashrl's reference path (dequantize per block, fp32 matmul)
everywhere, int8_g* the Triton group GEMM on CUDA and the reference on CPU (`flashrl.quant.dispatch`).
The GEMM is wrapped in a torch custom op, so torch.compile and CUDA graphs treat it as one opaque
call. Embeddings, the LM head, norms and attention are left to vLLM's unquantized methods; MoE
experts are quantized by `flashrl.vllm_backend.moe_methods` (routers stay in high precision).

With online smoothing (``smooth`` in the quantization config, ``rollout.smooth``) every quantization
of a layer first refreshes its SmoothQuant factors and encodes W * s, and the forward divides x by
s and gathers the activation statistics (`flashrl.vllm_backend.smoothing`).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import replace_parameter, set_weight_attrs
from vllm.platforms import current_platform

from flashrl.errors import WeightError
from flashrl.quant.dispatch import scaled_linear
from flashrl.quant.gemm import check_gemm_shape
from flashrl.quant.linear import QuantLinear
from flashrl.quant.schemes import get_scheme
from flashrl.vllm_backend import kernels, smoothing
from flashrl.vllm_backend.direct_load import (
    PROCESSED_FLAG,
    clear_staging,
    make_bias_loader,
    make_weight_loader,
)
from flashrl.vllm_backend.model_state import ModelState

logger = logging.getLogger(__name__)

_PROCESSED_FLAG = PROCESSED_FLAG
"""vLLM's marker for "already quantized": the loader calls `process_weights_after_loading` once
per layer during layerwise loading and once more in its final pass; layerwise reload deletes the
marker so the next reload quantizes again; a direct ``load_weights`` sees it set and stages."""


# ------------------------------------------------------------------------------------------------
# the GEMM as a custom op
# ------------------------------------------------------------------------------------------------


@torch.library.custom_op("flashrl::vllm_scaled_linear", mutates_args=())
def flashrl_scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    scheme: str,
    shard_sizes: list[int],
    kernel_id: int,
) -> torch.Tensor:
    """``x @ dequant(weight)^T + bias`` in x's dtype: vLLM's kernel bound under `kernel_id`
    (`flashrl.vllm_backend.kernels`), or `flashrl.quant.dispatch.scaled_linear` for ``kernel_id=-1``."""
    if kernel_id >= 0:
        return kernels.run_kernel(kernel_id, x, bias)
    return scaled_linear(x, weight, scale, get_scheme(scheme), bias, x.dtype, tuple(shard_sizes))


@flashrl_scaled_linear.register_fake
def _(x, weight, scale, bias, scheme, shard_sizes, kernel_id):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ------------------------------------------------------------------------------------------------
# linear method
# ------------------------------------------------------------------------------------------------


def _reload_targets(layer: torch.nn.Module, like: QuantLinear) -> dict[str, torch.Tensor] | None:
    """During vLLM's layerwise reload: the data of the code and scale tensors `layer` keeps
    (`LayerReloadingInfo.kernel_tensors`), which vLLM copies the new values into after
    `process_weights_after_loading`; None on a first load or when they do not match `like`'s
    buffers (shape, dtype, device)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    if info is None or info.kernel_tensors is None:
        return None
    kept = {**info.kernel_tensors[1], **info.kernel_tensors[0]}
    targets = {}
    for name in ("weight", "weight_scale", "row_scale"):
        want = getattr(like, name)
        if want is None:
            continue
        have = kept.get(name)
        if have is None or (have.shape, have.dtype) != (want.shape, want.dtype):
            return None
        targets[name] = have.data
    return targets


class FlashRLLinearMethod(LinearMethodBase):
    """bf16 weights in, flashrl codes and scales out; one instance per linear layer.

    Layer tensors after loading: ``weight`` (codes [N, K], int8 or float8_e4m3fn), ``weight_scale``
    (fp32, `QuantLinear`'s layout) and, for per-tensor fp8 over several shards, ``row_scale`` [N]
    (the per-row expansion the GEMM reads), ``flashrl_kernel`` (its vLLM kernel, or None) and
    ``flashrl_kernel_id`` (the handle the GEMM op passes). `state` is the model's
    (`flashrl.vllm_backend.model_state`: counters, staged layers, validated tensors).
    """

    uses_meta_device = True

    def __init__(self, scheme: str, smooth: float | None = None, *, state: ModelState) -> None:
        self.scheme = get_scheme(scheme)
        self.smooth = smooth
        """SmoothQuant exponent a (None: no smoothing; `flashrl.vllm_backend.smoothing`)."""
        self.state = state

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        out_features = sum(output_partition_sizes)
        prefix = getattr(layer, "prefix", "") or type(layer).__name__
        try:
            check_gemm_shape(
                self.scheme,
                input_size_per_partition,
                out_features,
                torch.device(current_platform.device_type),
            )
        except ValueError as err:
            raise ValueError(f"{prefix}: {err}") from None
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = out_features
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        layer.flashrl_params_dtype = params_dtype
        layer.flashrl_vllm_loader = vllm_loader
        weight = ModelWeightParameter(
            data=torch.empty(
                out_features, input_size_per_partition, dtype=params_dtype, device="meta"
            ),
            input_dim=1,
            output_dim=0,
            weight_loader=make_weight_loader(
                layer, vllm_loader, self._staging_weight, self._requantize_in_place, self.state
            ),
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        # Buffer this layer's checkpoint tensors and quantize once they are all there (first load).
        initialize_online_processing(layer)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, _PROCESSED_FLAG, False):
            return
        start = time.perf_counter()
        clear_staging(layer, self.state)  # a full (re)load supersedes shards staged by direct loads
        weight = layer.weight.data
        smoothing.attach(layer, self.smooth)
        # In vLLM's layerwise reload, quantize straight into the storages the layer keeps (vLLM's
        # copy-back is then a copy onto itself, which torch skips); on a first load, into new ones.
        quantized = self._quant_view(layer, None, weight, device="meta")
        targets = _reload_targets(layer, quantized)
        if targets is not None and all(t.device == weight.device for t in targets.values()):
            quantized = self._quant_view(layer, targets, weight)
        else:
            quantized = self._quant_view(layer, None, weight)
        try:
            smoothing.requantize(layer, quantized, weight)
        except ValueError as err:
            raise WeightError(f"{getattr(layer, 'prefix', '')}: {err}") from None
        replace_parameter(layer, "weight", quantized.weight)
        replace_parameter(layer, "weight_scale", quantized.weight_scale)
        if quantized.row_scale is not None:
            replace_parameter(layer, "row_scale", quantized.row_scale)
        bias = getattr(layer, "bias", None)
        if isinstance(bias, torch.nn.Parameter) and not getattr(bias, "flashrl_loader", False):
            bias.weight_loader = make_bias_loader(layer, bias.weight_loader, self.state)
            bias.flashrl_loader = True
        self._bind_kernel(layer)
        setattr(layer, _PROCESSED_FLAG, True)
        self._record_quantization(weight.device, start)

    def _record_quantization(self, device: torch.device, start: float) -> None:
        """Count one layer quantization that began at `start` (per-update stats and the log line)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.state.note_quantized(self.scheme.name, time.perf_counter() - start)

    def _bind_kernel(self, layer: torch.nn.Module) -> None:
        """Point the layer's vLLM kernel (`flashrl.vllm_backend.kernels`) at the tensors that persist.

        On a first load the layer's new tensors persist. During vLLM's layerwise reload they are
        temporaries that vLLM copies into the original storages after this method returns; the copy
        is done here first, so the kernel is built from the storages the forward will read.
        """
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        source: Any = layer
        kernel_tensors = get_layerwise_info(layer).kernel_tensors
        if kernel_tensors is not None:
            persistent = {**kernel_tensors[1], **kernel_tensors[0]}
            for name in ("weight", "weight_scale", "row_scale", "bias"):
                current = getattr(layer, name, None)
                if name in persistent and current is not None and persistent[name] is not current:
                    persistent[name].data.copy_(current)
            source = SimpleNamespace(
                weight=persistent["weight"],
                weight_scale=persistent["weight_scale"],
                row_scale=persistent.get("row_scale"),
                bias=persistent.get("bias"),
                logical_widths=layer.logical_widths,
                input_size_per_partition=layer.input_size_per_partition,
                output_size_per_partition=layer.output_size_per_partition,
            )
        if not hasattr(layer, "flashrl_kernel_id"):
            layer.flashrl_kernel = kernels.attach_kernel(
                self.scheme.name, source, layer.flashrl_params_dtype, self.state
            )
            layer.flashrl_kernel_id = kernels.handle_of(layer.flashrl_kernel)
        else:
            kernels.refresh_kernel(layer.flashrl_kernel_id, source)

    def _staging_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """An empty checkpoint-format weight for `direct_load` to stage shards in (vLLM's loader fills it)."""
        return ModelWeightParameter(
            data=torch.empty(
                layer.output_size_per_partition,
                layer.input_size_per_partition,
                dtype=layer.flashrl_params_dtype,
                device=layer.weight.device,
            ),
            input_dim=1,
            output_dim=0,
            weight_loader=layer.flashrl_vllm_loader,
        )

    def _quant_view(
        self,
        layer: torch.nn.Module,
        targets: dict[str, torch.Tensor] | None,
        weight: torch.Tensor,
        device: torch.device | str | None = None,
    ) -> QuantLinear:
        """A `QuantLinear` of `layer`'s shape writing into `targets` (``weight``, ``weight_scale``
        and ``row_scale`` storages), or into new buffers on `device` (default: `weight`'s) when
        `targets` is None."""
        view = QuantLinear(
            layer.input_size_per_partition,
            layer.output_size_per_partition,
            self.scheme,
            shard_sizes=layer.logical_widths,
            dtype=weight.dtype,
            device="meta" if targets is not None else (device or weight.device),
        )
        if targets is not None:
            view.weight = targets["weight"]
            view.weight_scale = targets["weight_scale"]
            if view.row_scale is not None:
                view.row_scale = targets["row_scale"]
        return view

    @torch.no_grad()
    def _requantize_in_place(self, layer: torch.nn.Module, weight: torch.Tensor) -> None:
        """Quantize a complete checkpoint-format `weight` into the layer's existing code and scale
        storages (same bits as `process_weights_after_loading`: both run `QuantLinear.requantize_`)."""
        targets = {
            name: getattr(layer, name).data
            for name in ("weight", "weight_scale", "row_scale")
            if getattr(layer, name, None) is not None
        }
        view = self._quant_view(layer, targets, weight)
        start = time.perf_counter()
        smoothing.requantize(layer, view, weight)
        kernels.refresh_kernel(getattr(layer, "flashrl_kernel_id", -1), layer)
        self._record_quantization(layer.weight.device, start)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        scale = getattr(layer, "row_scale", None)
        if scale is None:
            scale = layer.weight_scale
        state = smoothing.layer_smoothing(layer)
        if state is not None:
            return smoothing.flashrl_smoothed_linear(
                x,
                layer.weight,
                scale,
                bias,
                state.smooth,
                state.act_amax,
                self.scheme.name,
                layer.logical_widths,
                getattr(layer, "flashrl_kernel_id", -1),
            )
        return flashrl_scaled_linear(
            x,
            layer.weight,
            scale,
            bias,
            self.scheme.name,
            layer.logical_widths,
            getattr(layer, "flashrl_kernel_id", -1),
        )
