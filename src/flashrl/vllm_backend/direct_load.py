"""Direct ``model.load_weights`` into flashrl-quantized vLLM layers: validate, stage, re-quantize.

RL trainers update weights by calling the vLLM model's ``load_weights`` themselves, outside
vLLM's layerwise reload: TRL colocate and OpenRLHF one tensor per call, verl all tensors in one
call (shared/reference/vllm.md section 2.2b). Without help, such a load reaches a quantized
layer's *code* parameter with a float checkpoint tensor: fused layers fail vLLM's shape assert,
unfused ones get float values cast into int8/fp8 codes under stale scales.

flashrl's linear method therefore installs its own ``weight_loader`` on every parameter it owns
(`make_weight_loader`, `make_bias_loader`). The loader

1. refuses a non-float tensor or one holding NaN/Inf (`WeightError` naming the parameter) before
   anything of the layer changes;
2. while the layer holds checkpoint-format tensors (first load, vLLM's layerwise reload, the
   element-counting dry run on meta tensors) passes the tensor to vLLM's own loader unchanged;
3. once the layer is quantized, stages the tensor at checkpoint precision in a buffer of the
   layer's checkpoint shape, loaded by vLLM's own (tensor-parallel, shard-aware) loader, and when
   every shard of the layer has arrived (q, k and v; gate and up; the whole weight otherwise)
   re-quantizes the staged weight *into the existing code and scale storages* and frees the buffer.

Every incoming tensor is checked for NaN/Inf once (`check_incoming`, one `torch.aminmax` pass):

- a direct load checks it on arrival, before it is staged;
- vLLM's layerwise loading (first load, ``reload_weights``, weight-transfer backends) calls each
  loader twice per tensor, on the meta parameter to count elements and on the materialized one to
  load: only the second call checks. A quantized layer's weight is not checked there at all: the
  quantizer takes its amax anyway and refuses NaN/Inf in the same pass (`WeightError` naming the
  layer, from `process_weights_after_loading`);
- tensors a sender validated whole (`WeightUpdater`, marked ``prechecked`` in its chunks:
  `ModelState.prechecked`) are not checked again.

A layer whose shards never all arrive keeps its previous weights whole (never half old, half
new). `report_pending` logs a warning per such layer naming the missing shards and counts it in
``load_stats(model)["incomplete_groups"]``; flashrl's LM-head method calls it before every logits
computation, which vLLM runs eagerly, so an update that ends incomplete is reported at the next
generation step.

Counters, staged layers and validated tensors are kept per model, in the `ModelState` every loader
here is given (`flashrl.vllm_backend.model_state`); staged tensors live on their layer.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashrl.errors import WeightError
from flashrl.vllm_backend.model_state import ModelState, state_of

logger = logging.getLogger(__name__)

PROCESSED_FLAG = "_already_called_process_weights_after_loading"
"""vLLM's marker for a layer whose checkpoint tensors have been processed (quantized)."""


def load_stats(model: torch.nn.Module, reset: bool = False) -> dict[str, float]:
    """Counters of direct loads into the vLLM `model` (`ModelState.load_stats`): ``direct_tensors``
    (tensors staged), ``layers_requantized`` (layers re-quantized from staged tensors),
    ``incomplete_groups`` (layers reported with missing shards), ``requantize_s`` (seconds
    re-quantizing), ``pending_layers`` (layers holding staged shards now). `reset` zeroes the
    counters after reading. From outside the worker: ``llm.collective_rpc("flashrl_load_stats")``."""
    return state_of(model).load_stats(reset)


def check_incoming(tensor: Any, name: str, finite: bool = True) -> None:
    """Raise `WeightError` unless `tensor` is a floating-point tensor (not on meta) and, with
    `finite`, holds no NaN/Inf (one full pass; without it the check costs nothing)."""
    if not isinstance(tensor, torch.Tensor):
        raise WeightError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise WeightError(
            f"{name}: tensor has dtype {tensor.dtype}; weights must be floating point "
            "(float32, bfloat16, float16)"
        )
    if tensor.is_meta:
        raise WeightError(f"{name}: tensor is on the meta device (no data)")
    # aminmax propagates NaN and carries +-Inf: one pass, no tensor-sized temporary (an isfinite
    # mask cost a third of an update at 0.5B dims; bf16 amax + amin take 20x a copy on CPU, aminmax
    # about one copy). The full count runs only on failure.
    if (
        finite
        and tensor.numel()
        and not bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())
    ):
        bad = int((~torch.isfinite(tensor)).sum())
        raise WeightError(
            f"{name}: refusing a tensor with {bad} NaN/Inf value(s) of {tensor.numel()}; "
            "the layer keeps its previous weights"
        )


def _check_loaded(state: ModelState, param: torch.Tensor, tensor: Any, name: str) -> None:
    """`check_incoming` for a loader call: the finiteness pass only where `state.needs_check`."""
    check_incoming(tensor, name, finite=state.needs_check(param, tensor))


def shard_ids(layer: torch.nn.Module) -> tuple[Any, ...]:
    """The shard ids vLLM's model loaders pass for `layer`'s checkpoint tensors."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.output_sizes)))
    return (None,)


def _call_loader(loader: Callable, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any) -> Any:
    return loader(param, loaded) if shard_id is None else loader(param, loaded, shard_id)


def _arrived_shards(layer: torch.nn.Module, shard_id: Any) -> set[Any]:
    if shard_id is None:  # the whole (possibly already fused) weight
        return set(shard_ids(layer))
    return set(shard_id) if isinstance(shard_id, tuple) else {shard_id}


@dataclass
class Staging:
    """Tensors of one layer waiting for the rest of their group."""

    weight: torch.Tensor
    arrived: set[Any] = field(default_factory=set)
    bias: torch.Tensor | None = None
    reported: bool = False


def _name(layer: torch.nn.Module, what: str, shard_id: Any = None) -> str:
    prefix = getattr(layer, "prefix", "") or type(layer).__name__
    return f"{prefix}.{what}" + (f" (shard {shard_id!r})" if shard_id is not None else "")


def make_weight_loader(
    layer: torch.nn.Module,
    vllm_loader: Callable,
    new_staging_weight: Callable[[torch.nn.Module], torch.Tensor],
    requantize: Callable[[torch.nn.Module, torch.Tensor], None],
    state: ModelState,
) -> Callable:
    """The ``weight_loader`` of a flashrl-quantized layer's weight (see the module docstring).

    `new_staging_weight(layer)` makes a checkpoint-format parameter vLLM's loader can fill;
    `requantize(layer, weight)` re-quantizes the layer in place from a complete staged weight;
    `state` is the model's (counters, staged layers, validated tensors).
    """
    layer_ref = weakref.ref(layer)

    def weight_loader(
        param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: Any = None
    ) -> Any:
        owner = layer_ref()
        assert owner is not None, "weight loader of a freed layer"
        if param.is_meta or not getattr(owner, PROCESSED_FLAG, False):
            # Checkpoint format (first load, layerwise reload): the quantizer refuses NaN/Inf in
            # its own amax pass (process_weights_after_loading), so no finiteness pass here.
            check_incoming(loaded_weight, _name(owner, "weight", loaded_shard_id), finite=False)
            return _call_loader(vllm_loader, param, loaded_weight, loaded_shard_id)
        _check_loaded(state, param, loaded_weight, _name(owner, "weight", loaded_shard_id))
        staging = getattr(owner, "_flashrl_staging", None)
        if staging is None:
            staging = Staging(weight=new_staging_weight(owner))
            owner._flashrl_staging = staging
            state.pending.add(owner)
        _call_loader(vllm_loader, staging.weight, loaded_weight, loaded_shard_id)
        staging.arrived |= _arrived_shards(owner, loaded_shard_id)
        staging.reported = False
        state.count_direct_tensor()
        if staging.arrived >= set(shard_ids(owner)):
            start = time.perf_counter()
            requantize(owner, staging.weight.data)
            if staging.bias is not None:
                owner.bias.data.copy_(staging.bias)
            clear_staging(owner, state)
            state.count_requantized(time.perf_counter() - start)
        return None

    return weight_loader


def make_bias_loader(layer: torch.nn.Module, vllm_loader: Callable, state: ModelState) -> Callable:
    """The ``weight_loader`` of a flashrl-quantized layer's bias: validated, and staged with the
    weight while the layer waits for weight shards (written with them), else loaded in place."""
    layer_ref = weakref.ref(layer)

    def bias_loader(
        param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: Any = None
    ) -> Any:
        owner = layer_ref()
        assert owner is not None, "bias loader of a freed layer"
        _check_loaded(state, param, loaded_weight, _name(owner, "bias", loaded_shard_id))
        staging = getattr(owner, "_flashrl_staging", None)
        if param.is_meta or staging is None or not getattr(owner, PROCESSED_FLAG, False):
            return _call_loader(vllm_loader, param, loaded_weight, loaded_shard_id)
        if staging.bias is None:
            staging.bias = torch.nn.Parameter(param.data.clone(), requires_grad=False)
            for attr in ("output_dim", "input_dim", "is_sharded_weight"):
                if hasattr(param, attr):
                    setattr(staging.bias, attr, getattr(param, attr))
        return _call_loader(vllm_loader, staging.bias, loaded_weight, loaded_shard_id)

    return bias_loader


def make_checked_loader(
    layer: torch.nn.Module,
    vllm_loader: Callable,
    state: ModelState,
    on_loaded: Callable[[], None] | None = None,
) -> Callable:
    """A ``weight_loader`` for layers flashrl keeps in high precision (embeddings, LM head, skipped
    linears): validates the tensor, runs vLLM's loader, then calls `on_loaded` (real loads only).

    In vLLM's layerwise reload the loader writes into the weight the layer keeps rather than into
    the new stand-in vLLM materialized for it (`kept_weight`): vLLM would copy the stand-in into
    the kept weight afterwards, so for a 151936 x 896 embedding this saves a 272 MB copy and the
    page faults of first touching the stand-in (the two took 0.4 s of a 0.5 s sync at 0.5B dims)."""
    layer_ref = weakref.ref(layer)

    def checked_loader(
        param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: Any = None
    ) -> Any:
        owner = layer_ref()
        assert owner is not None, "weight loader of a freed layer"
        _check_loaded(state, param, loaded_weight, _name(owner, "weight", loaded_shard_id))
        kept = kept_weight(owner, param)
        if kept is not None:  # vLLM's copy-back is then a copy onto itself, which torch skips
            owner.weight = param = kept
        result = _call_loader(vllm_loader, param, loaded_weight, loaded_shard_id)
        if on_loaded is not None and not param.is_meta:
            on_loaded()
        return result

    return checked_loader


def kept_weight(layer: torch.nn.Module, param: torch.Tensor) -> torch.nn.Parameter | None:
    """In vLLM's layerwise reload, the ``weight`` `layer` keeps (its storage survives the reload:
    `LayerReloadingInfo.kernel_tensors`) when `param` is the stand-in vLLM materialized for it
    and both match in shape, dtype and device; None otherwise (first load, direct load, dry run)."""
    if param.is_meta or getattr(layer, "weight", None) is not param:
        return None
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    kept = info.kernel_tensors[0].get("weight") if info and info.kernel_tensors else None
    if not isinstance(kept, torch.nn.Parameter) or kept is param:
        return None
    if (kept.shape, kept.dtype, kept.device) != (param.shape, param.dtype, param.device):
        return None
    return kept


def clear_staging(layer: torch.nn.Module, state: ModelState) -> None:
    """Drop `layer`'s staged tensors (once re-quantized, or when a full reload supersedes them).
    A layer holding staged tensors is in ``state.pending`` (`report_pending` asks a staging object
    with a ``missing()`` method what is missing; `moe_loading` stages that way)."""
    if getattr(layer, "_flashrl_staging", None) is not None:
        layer._flashrl_staging = None
    state.pending.discard(layer)


def on_step(state: ModelState) -> int:
    """Called before every logits computation of the model `state` belongs to: logs the
    quantizations done since the last call (one INFO line per weight update) and reports incomplete
    groups (`report_pending`)."""
    unlogged = state.unlogged
    if unlogged["layers"]:
        logger.info(
            "re-quantized %d linear layers (%s) in %.3f s",
            unlogged["layers"],
            ", ".join(sorted(unlogged["schemes"])),
            unlogged["seconds"],
        )
        unlogged.update(layers=0, seconds=0.0, schemes=set())
    return report_pending(state)


def report_pending(state: ModelState) -> int:
    """Warn once per layer of `state`'s model whose staged group is still incomplete (naming the
    missing shards) and count it in ``incomplete_groups``; returns the number of such layers. Cheap
    when none."""
    if not state.pending:
        return 0
    for layer in list(state.pending):
        staging = layer._flashrl_staging
        if staging is None or staging.reported:
            continue
        if hasattr(staging, "missing"):
            missing = staging.missing()
        else:
            missing = [s for s in shard_ids(layer) if s not in staging.arrived]
        logger.warning(
            "%s: incomplete weight update: received shard(s) %s but not %s; the layer keeps its previous "
            "weights until all of them arrive (send q/k/v and gate/up together every update)",
            _name(layer, "weight"),
            sorted(map(str, staging.arrived)),
            [str(s) for s in missing],
        )
        staging.reported = True
        state.direct["incomplete_groups"] += 1
    return len(state.pending)
