"""The ``flashrl`` weight-transfer backend (inference side) and the ``flashrl_*`` worker methods.

vLLM's weight-transfer API (`vllm/distributed/weight_transfer`) splits a weight update into
``start_weight_update`` / ``update_weights`` (any number of chunks) / ``finish_weight_update``;
the backend decides how tensors travel. vLLM ships CUDA backends (NCCL, CUDA IPC). This one works
on every device with no rendezvous:

- in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) receive the trainer's tensors
  themselves (``update_info = {"names": [...], "tensors": [...]}``; with ``"prechecked": True``
  the sender vouches it validated them whole, and the loaders do not scan them again);
- multi-process engines receive the path of a safetensors file the trainer wrote for the chunk
  (``update_info = {"names": [...], "path": "/dev/shm/..."}``).

Each chunk goes through ``model.load_weights`` inside vLLM's layerwise reload, so every layer is
re-quantized (`FlashRLLinearMethod.process_weights_after_loading`) as soon as its tensors are
complete. `WeightUpdater` (trainer side) drives it; the backend is registered by
`flashrl.vllm_backend.plugin.register` under the name ``flashrl``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from flashrl.vllm_backend.model_state import state_of


@dataclass
class FlashRLTransferInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the data plane is the Python call (in-process) or a file."""


@dataclass
class FlashRLTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of checkpoint-format tensors: `tensors` (in-process) or a safetensors `path`.
    `prechecked`: the sender validated `tensors` whole (finite floats), e.g. `WeightUpdater`."""

    names: list[str]
    tensors: list[torch.Tensor] | None = None
    path: str | None = None
    prechecked: bool = False

    def __post_init__(self) -> None:
        if (self.tensors is None) == (self.path is None):
            raise ValueError("flashrl update_info needs exactly one of `tensors` or `path`")
        if self.tensors is not None and len(self.tensors) != len(self.names):
            raise ValueError(
                f"flashrl update_info has {len(self.names)} names but {len(self.tensors)} tensors"
            )


class FlashRLWeightTransferEngine(
    WeightTransferEngine[FlashRLTransferInitInfo, FlashRLTransferUpdateInfo]
):
    """Loads checkpoint-format chunks through vLLM's layerwise reload (re-quantizing every layer)."""

    init_info_cls = FlashRLTransferInitInfo
    update_info_cls = FlashRLTransferUpdateInfo

    def init_transfer_engine(self, init_info: FlashRLTransferInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which has no accelerator on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: FlashRLTransferUpdateInfo) -> None:
        if update_info.path is not None:
            from safetensors.torch import load_file

            loaded = load_file(update_info.path)
            missing = [name for name in update_info.names if name not in loaded]
            if missing:
                raise ValueError(f"{update_info.path} lacks tensor(s) {missing[:5]}")
            weights = [(name, loaded[name]) for name in update_info.names]
        else:
            weights = list(zip(update_info.names, update_info.tensors))
        vouched = update_info.tensors if update_info.prechecked and update_info.tensors else []
        with disable_mtp_completeness_check(), state_of(self.model).prechecked(vouched):
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_cpu_kernels(self.model)

    def shutdown(self) -> None:
        return None


def refresh_tied_cpu_kernels(model: torch.nn.Module) -> int:
    """Rebuild the CPU GEMM state of layers whose weight is tied to another layer's; returns how many.

    On the CPU platform, vLLM's unquantized methods pack each weight into a oneDNN handle at load
    time (``layer.cpu_linear``). A tied LM head (``tie_word_embeddings``) receives no tensor of its
    own in a reload, so layerwise reload leaves its handle packed from the *old* embedding although
    the shared weight tensor was updated in place: logits would come from stale weights. Running
    the layer's own ``process_weights_after_loading`` again repacks it from the current weight.
    Other devices read the weight tensor on every call and need nothing.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    by_storage: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel() > 0:
            by_storage.setdefault(weight.data_ptr(), []).append(module)
    refreshed = 0
    for modules in by_storage.values():
        if len(modules) < 2:
            continue
        for module in modules:
            if hasattr(module, "cpu_linear") and getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


class FlashRLWorkerExtension:
    """Methods added to every vLLM worker by ``LLM(worker_extension_cls=...)``.

    vLLM's workers already own ``update_weights``, ``reload_weights`` and friends, so every method
    here carries the ``flashrl_`` prefix. Call them with ``llm.collective_rpc("flashrl_...")``.
    """

    def flashrl_worker_info(self) -> dict[str, Any]:
        """Process id, device and weight-transfer backend of this worker (WeightUpdater picks its
        transport from the pid: same process as the trainer means tensors can be passed directly)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {
            "pid": os.getpid(),
            "device": str(getattr(self, "device", "")),
            "transfer_engine": type(engine).__name__ if engine is not None else None,
        }

    def flashrl_linear_methods(self) -> dict[str, str]:
        """``{module name: quantization method class}`` of every linear layer of the model, e.g.
        ``{"model.layers.0.mlp.down_proj": "UnquantizedLinearMethod", ...}``: which layers run quantized."""
        from vllm.model_executor.layers.linear import LinearBase

        model = self.model_runner.get_model()
        return {
            name: type(module.quant_method).__name__
            for name, module in model.named_modules()
            if isinstance(module, LinearBase)
        }

    def flashrl_set_kv_scales(
        self,
        k_scales: list[float] | float,
        v_scales: list[float] | float,
        q_scales: list[float] | float | None = None,
    ) -> int:
        """Set the FP8 KV-cache scales of every attention layer (one value per decoder layer, or one
        for all), in place; returns how many layers were set. vLLM resets hand-set scales to 1.0 on
        every reload, so `WeightUpdater` calls this after each update."""
        from flashrl.vllm_backend.kv_scales import set_attention_kv_scales

        return set_attention_kv_scales(self.model_runner.get_model(), k_scales, v_scales, q_scales)

    def flashrl_kv_scales(self) -> list[dict[str, float]]:
        """Per decoder layer: the K, V and Q scales as vLLM's attention reads them (the device tensor
        and the host float, which must agree)."""
        from flashrl.vllm_backend.kv_scales import attention_layers

        return [
            {
                "layer": index,
                "k": float(attn._k_scale),
                "v": float(attn._v_scale),
                "q": float(attn._q_scale),
                "k_float": attn._k_scale_float,
                "v_float": attn._v_scale_float,
            }
            for index, attn in attention_layers(self.model_runner.get_model())
        ]

    def flashrl_load_stats(self, reset: bool = False) -> dict[str, float]:
        """Direct ``load_weights`` counters of this worker (`flashrl.vllm_backend.direct_load.load_stats`):
        tensors staged, layers re-quantized, incomplete groups reported, layers still pending."""
        from flashrl.vllm_backend.direct_load import load_stats

        return load_stats(self.model_runner.get_model(), reset)

    def flashrl_linear_kernels(self) -> dict[str, str]:
        """``{module name: GEMM}`` of every flashrl-quantized layer: a vLLM kernel class name, or
        ``flashrl`` for flashrl's own op (`flashrl.vllm_backend.kernels`)."""
        from flashrl.vllm_backend.kernels import kernel_name

        model = self.model_runner.get_model()
        return {
            name: kernel_name(module.flashrl_kernel_id)
            for name, module in model.named_modules()
            if hasattr(module, "flashrl_kernel_id")
        }

    def flashrl_reset_smoothing_stats(self) -> int:
        """Start a new activation-statistics window in every smoothed layer (drops what vLLM's
        start-up dummy forwards gathered); returns how many layers are smoothed."""
        from flashrl.vllm_backend.smoothing import reset_statistics

        return reset_statistics(self.model_runner.get_model())

    def flashrl_pop_requantize_stats(self) -> dict[str, float]:
        """Seconds spent re-quantizing and layers re-quantized in this worker's model since the last
        call (then reset; `ModelState.pop_requantize_stats`)."""
        return state_of(self.model_runner.get_model()).pop_requantize_stats()
