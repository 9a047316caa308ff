"""Direct ``model.load_weights`` into flashrl-quantized vLLM MoE experts (`moe_methods`).

vLLM hands the expert ``weight_loader`` one expert at a time (``shard_id`` ``w1`` gate, ``w3`` up,
``w2`` down; ``expert_id`` global), for per-expert checkpoint names and for the fused 3-D names of a
`transformers` model alike. `make_expert_loader` validates every tensor (a fused tensor whole,
before any expert changes), passes it to vLLM's loader while the layer holds checkpoint-format
tensors, and once the layer is quantized stages it per expert and calls ``method.requantize_expert`` when an
expert's w13 (gate + up) or w2 is complete. `ExpertStaging` is what `direct_load.report_pending`
reports for a layer still waiting (``expert 5 w3`` missing).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashrl.errors import WeightError
from flashrl.vllm_backend import direct_load
from flashrl.vllm_backend.model_state import ModelState

PARTS: dict[str, tuple[str, ...]] = {"w13": ("w1", "w3"), "w2": ("w2",)}
"""vLLM's shard ids of each stacked expert weight: gate (w1) and up (w3) rows of w13; down (w2)."""


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


def check_expert_tensor(tensor: Any, what: str, state: ModelState, finite: bool = True) -> None:
    """`direct_load.check_incoming` on the tensor and, once, on the fused tensor it is a view of,
    so that a NaN anywhere in a fused expert tensor is refused before any expert changes
    (`finite=False`: the type checks only). vLLM hands a fused [E, ...] tensor to the loader one
    expert at a time, as views of it: ``state.checked_base`` remembers the fused tensor last
    validated whole (weakly, with its version)."""
    base = getattr(tensor, "_base", None)
    if finite and isinstance(base, torch.Tensor) and base.is_floating_point() and not base.is_meta:
        ref, version = state.checked_base
        if ref is None or ref() is not base or version != base._version:
            direct_load.check_incoming(
                base, f"{what}, in a fused tensor of shape {tuple(base.shape)}"
            )
            state.checked_base = (weakref.ref(base), base._version)
    direct_load.check_incoming(tensor, what, finite=finite)


def make_expert_loader(layer: torch.nn.Module, vllm_loader: Callable, method: Any) -> Callable:
    """The ``weight_loader`` of a flashrl-quantized MoE layer's ``w13_weight`` / ``w2_weight``:
    validates every tensor; passes it to vLLM's loader while the layer holds checkpoint-format
    tensors; once the layer is quantized, stages it per expert and re-quantizes that expert's part
    in place with ``method.requantize_expert(layer, part, expert, weight)`` when its shards are complete.
    Counters and validated tensors are the model's (``method.state``)."""
    layer_ref = weakref.ref(layer)
    state: ModelState = method.state

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
        base = getattr(loaded_weight, "_base", None)
        check_expert_tensor(
            loaded_weight,
            what,
            state,
            finite=state.needs_check(param, loaded_weight)
            and (base is None or state.needs_check(param, base)),
        )
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
        stage(owner, vllm_loader, method, (loaded_weight, weight_name, shard_id, expert_id), local)
        return True if return_success else None

    return weight_loader


def stage(
    layer: torch.nn.Module, vllm_loader: Callable, method: Any, args: tuple, local: int
) -> None:
    """Load one expert tensor (`args`: vLLM's loader arguments after ``param``) into the layer's
    staging buffer for (part, `local` expert) and re-quantize the part once all its shards arrived."""
    shard_id, state = args[2], method.state
    part = "w2" if shard_id == "w2" else "w13"
    staging = getattr(layer, "_flashrl_staging", None)
    if staging is None:
        staging = layer._flashrl_staging = ExpertStaging()
        state.pending.add(layer)
    key, shape = (part, local), getattr(layer, f"{part}_weight").shape
    if key not in staging.buffers:
        staging.buffers[key] = torch.empty(
            shape[1:], dtype=layer.flashrl_params_dtype, device=layer.w13_weight.device
        )
        staging.shards[key] = set()
    # vLLM's loader indexes [local expert]; every index of this expanded view is the one buffer.
    vllm_loader(staging.buffers[key].unsqueeze(0).expand(shape[0], -1, -1), *args, True)
    staging.shards[key].add(shard_id)
    staging.reported = False
    state.count_direct_tensor()
    if staging.shards[key] >= set(PARTS[part]):
        start = time.perf_counter()
        method.requantize_expert(layer, part, local, staging.buffers.pop(key))
        del staging.shards[key]
        state.count_requantized(time.perf_counter() - start)
        if not staging.buffers:
            direct_load.clear_staging(layer, state)
