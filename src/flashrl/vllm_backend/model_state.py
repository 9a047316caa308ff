"""`ModelState`: what flashrl keeps between calls for one vLLM model (one engine's model).

Why an object and not module globals: two engines in one process (a trainer's engine beside a
reference engine, `flashrl compare`, the tests) must keep separate counters, and nothing of an
engine may outlive it. The engine's quantization config (`FlashRLQuantConfig`) makes one
`ModelState` and hands it to every quant method it creates, so the layers of one model share it,
the layers of another model never do, and it lives as long as the engine's config and layers.
What belongs to one layer stays on the layer (``_flashrl_staging``, ``flashrl_kernel``).

It holds:

- the counters read through the worker extension: `load_stats` (direct ``load_weights`` calls) and
  `pop_requantize_stats` (every quantization, read by `WeightUpdater` after an update);
- the layers holding staged tensors (weakly), reported by `direct_load.report_pending`, and the
  quantizations not yet logged (`direct_load.on_step`);
- the tensors a sender validated whole (`prechecked`) and the fused expert tensor last validated
  (`moe_loading.check_expert_tensor`);
- the count of embedding loads (the CPU LM-head repack, `dense_methods`) and the kernel choices
  already logged (`kernels`).

`state_of` finds a model's state from its layers (the worker extension has only the model).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ModelState:
    """flashrl's state for one vLLM model (see the module docstring).

    A copy starts empty (`__reduce__`): vLLM pickles its config, which holds this object, into the
    engine's processes before any layer exists, and a state belongs to the layers of one process.
    """

    def __init__(self) -> None:
        self.direct: dict[str, float] = {
            "direct_tensors": 0,
            "layers_requantized": 0,
            "incomplete_groups": 0,
            "requantize_s": 0.0,
        }
        """Direct-load counters: tensors staged, layers re-quantized from staged tensors and their
        seconds, layers reported with missing shards."""
        self.requantized: dict[str, float] = {"requantize_s": 0.0, "layers_requantized": 0}
        """Every quantization on any load path (linear and MoE layers) since the last pop."""
        self.unlogged: dict[str, Any] = {"layers": 0, "seconds": 0.0, "schemes": set()}
        """Quantizations since the last `direct_load.on_step` log line."""
        self.pending: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        """Layers holding staged tensors in ``layer._flashrl_staging``."""
        self.checked: dict[int, torch.Tensor] = {}
        """Tensors validated whole for the load in progress (id -> the tensor, held so that no other
        tensor can take its id while it is here); see `prechecked`."""
        self.checked_base: tuple[weakref.ref | None, int] = (None, -1)
        """The fused expert tensor last validated whole (weak reference, ``_version``)."""
        self.embedding_loads = 0
        """Loads into any embedding / LM-head weight of this model; an LM head whose packed CPU
        kernel predates the latest load repacks before its next use."""
        self.logged_kernels: set[tuple[str, str]] = set()
        """(scheme, kernel choice) pairs already logged for this model."""

    def __reduce__(self) -> tuple[type, tuple]:
        return (ModelState, ())

    # ---------------------------------------------------------------- counters

    def load_stats(self, reset: bool = False) -> dict[str, float]:
        """Direct-load counters: ``direct_tensors`` (tensors staged), ``layers_requantized`` (layers
        re-quantized from staged tensors), ``incomplete_groups`` (layers reported with missing
        shards), ``requantize_s`` (seconds re-quantizing), ``pending_layers`` (layers holding
        staged shards now). `reset` zeroes the counters after reading."""
        stats = {**self.direct, "pending_layers": float(len(self.pending))}
        if reset:
            self.direct.update(
                direct_tensors=0, layers_requantized=0, incomplete_groups=0, requantize_s=0.0
            )
        return stats

    def pop_requantize_stats(self) -> dict[str, float]:
        """Seconds spent quantizing and the number of layers (linear and MoE) quantized since the
        last call; resets both."""
        stats = dict(self.requantized)
        self.requantized.update(requantize_s=0.0, layers_requantized=0)
        return stats

    def note_quantized(self, scheme: str, seconds: float) -> None:
        """Count one layer quantization (any load path): `pop_requantize_stats` and the next
        `direct_load.on_step` log line."""
        self.requantized["requantize_s"] += seconds
        self.requantized["layers_requantized"] += 1
        self.unlogged["layers"] += 1
        self.unlogged["seconds"] += seconds
        self.unlogged["schemes"].add(scheme)

    def count_direct_tensor(self) -> None:
        """Count one tensor staged by a direct load (``direct_tensors``)."""
        self.direct["direct_tensors"] += 1

    def count_requantized(self, seconds: float) -> None:
        """Count one group re-quantized from staged tensors (``layers_requantized``,
        ``requantize_s``)."""
        self.direct["layers_requantized"] += 1
        self.direct["requantize_s"] += seconds

    def count_embedding_load(self) -> None:
        """Count one load into an embedding or LM-head weight (see `embedding_loads`)."""
        self.embedding_loads += 1

    def log_once(self, key: tuple[str, str]) -> bool:
        """True the first time `key` is seen for this model (a kernel choice to log)."""
        if key in self.logged_kernels:
            return False
        self.logged_kernels.add(key)
        return True

    # ---------------------------------------------------------------- validated tensors

    @contextmanager
    def prechecked(self, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """Within the block, this model's loaders skip the NaN/Inf scan for exactly these tensor
        objects (the sender checked them, e.g. `WeightUpdater` before sending anything). Views or
        copies of them are checked as usual."""
        saved = dict(self.checked)
        self.checked.update({id(t): t for t in tensors})
        try:
            yield
        finally:
            self.checked.clear()
            self.checked.update(saved)

    def needs_check(self, param: torch.Tensor, tensor: Any) -> bool:
        """Whether a loader call must scan `tensor` for NaN/Inf: not in vLLM's element-counting dry
        run (a meta `param`: the same tensor comes back with the materialized parameter), not for
        `prechecked` tensors."""
        return not param.is_meta and self.checked.get(id(tensor)) is not tensor


def state_of(model: torch.nn.Module) -> ModelState:
    """The `ModelState` the layers of `model` share (through their quant methods); an empty one for
    a model without flashrl's methods (a bf16 engine), which has nothing to count."""
    for module in model.modules():
        state = getattr(getattr(module, "quant_method", None), "state", None)
        if isinstance(state, ModelState):
            return state
    return ModelState()
