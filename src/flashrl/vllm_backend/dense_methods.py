"""flashrl's vLLM methods for layers kept in high precision: embeddings, the LM head, skipped linears.

They compute exactly what vLLM's unquantized methods compute; what they add is what direct
``load_weights`` calls need (`flashrl.vllm_backend.direct_load`): validated loads, the CPU LM-head
repack after an embedding load, a plain weight for skipped linears on CPU, and the per-step hook
(`direct_load.on_step`) that reports incomplete groups and logs re-quantizations.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.platforms import current_platform

from flashrl.vllm_backend import direct_load
from flashrl.vllm_backend.model_state import ModelState

logger = logging.getLogger(__name__)


class FlashRLEmbeddingMethod(UnquantizedEmbeddingMethod):
    """Embeddings and the LM head, in high precision as vLLM's unquantized method keeps them, plus:

    - incoming tensors are validated (`direct_load.check_incoming`);
    - on CPU, vLLM packs the LM head into a oneDNN handle at load time; a tied head receives no
      tensor of its own when the embedding is loaded directly, so the handle would keep the old
      embedding. `apply` repacks whenever an embedding or LM-head load happened since the pack;
    - `apply` runs eagerly before every sampling step (vLLM computes logits outside the compiled
      model), so it is where incomplete direct loads are reported (`direct_load.report_pending`).

    Embedding loads are counted per model (``state.embedding_loads``): a load into another engine's
    embedding does not repack this one's head.
    """

    def __init__(self, *, state: ModelState) -> None:
        super().__init__()
        self.state = state

    def create_weights(self, layer: torch.nn.Module, *args: Any, **extra_weight_attrs: Any) -> None:
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        state = self.state
        checked = direct_load.make_checked_loader(
            layer, vllm_loader, state, state.count_embedding_load
        )
        super().create_weights(layer, *args, weight_loader=checked, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.flashrl_packed_loads = self.state.embedding_loads

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        loads = self.state.embedding_loads
        direct_load.on_step(self.state)
        if current_platform.is_cpu() and getattr(layer, "flashrl_packed_loads", None) != loads:
            super().process_weights_after_loading(layer)
            layer.flashrl_packed_loads = loads
            logger.info(
                "%s: repacked the CPU LM-head kernel after a weight load",
                getattr(layer, "prefix", "lm_head"),
            )
        return super().apply(layer, x, bias)


class FlashRLDenseLinearMethod(UnquantizedLinearMethod):
    """Linear layers a skip list keeps in high precision: vLLM's unquantized method with validated
    loads, except on CPU, where vLLM packs the weight into a oneDNN handle and drops
    ``layer.weight`` (no direct ``load_weights`` could reach it): the weight stays a plain tensor
    and the forward is ``F.linear``. `state` is the model's (validated tensors)."""

    def __init__(self, *, state: ModelState) -> None:
        super().__init__()
        self.state = state

    def create_weights(self, layer: torch.nn.Module, *args: Any, **extra_weight_attrs: Any) -> None:
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        super().create_weights(
            layer,
            *args,
            weight_loader=direct_load.make_checked_loader(layer, vllm_loader, self.state),
            **extra_weight_attrs,
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not current_platform.is_cpu():
            super().process_weights_after_loading(layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if current_platform.is_cpu():
            return torch.nn.functional.linear(x, layer.weight, bias)
        return super().apply(layer, x, bias)
