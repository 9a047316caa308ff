"""Routing replay: the trainer's `transformers` MoE layers use the experts the rollout engine chose.

A small change in router logits (bf16 vs fp32, a quantized layer below) can pick other experts, and
then trainer and rollout compute different functions: the largest source of rollout/trainer
mismatch in MoE models. With replay, each router's top-k ids are replaced by the ids the engine
recorded for that token (`Rollout.routed_experts`, `flashrl.engine.routing.RoutingCapture`); the
top-k weights are recomputed from the trainer's own router logits for those ids with the family's
rule (`flashrl.model.moe.replay_weights`), so gradients still reach the router.

How: a forward hook on each router module (``model.layers.L.mlp.gate`` of Qwen3-MoE, Qwen2-MoE and
Mixtral in transformers 5.x, which return ``(logits, weights, ids)``) rewrites its output while
`replay_routing` is active; transformers itself is not modified. Positions without recorded ids
(padding, the last response token, which the engine never ran) keep the trainer's own routing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from flashrl.core.rollout import Rollout, RolloutBackend
from flashrl.engine.routing import RoutingBackend
from flashrl.errors import ConfigError, InputError
from flashrl.model.moe import replay_weights
from flashrl.model.moe_config import MoEConfig
from flashrl.rl.batch import Batch


def replay_backend(backend: RolloutBackend | None, make: Any) -> RoutingBackend:
    """`algo.routing_replay`: the built-in engine (`backend`, or ``make()``) wrapped so that its
    rollouts carry the routing to replay; other backends are refused with a `ConfigError`."""
    from flashrl.engine.engine import Engine

    engine = backend if backend is not None else make()
    if not isinstance(engine, Engine):
        raise ConfigError(
            f"algo.routing_replay needs the built-in engine in the trainer's process "
            f"(rollout.backend builtin, rollout.workers.count 0), got {type(engine).__name__}"
        )
    return RoutingBackend(engine)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of a `transformers` MoE causal LM, in layer order (empty if dense)."""
    layers = model.get_decoder().layers
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "experts")]


def routing_rule(model: torch.nn.Module) -> MoEConfig:
    """The top-k weight rule of `model`'s routers (only the fields `replay_weights` reads)."""
    config = model.config
    mixtral = config.model_type == "mixtral"
    return MoEConfig(
        num_experts=0,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=0,
        norm_topk_prob=True if mixtral else bool(config.norm_topk_prob),
        sparse_layers=(),
        weights_in_router_dtype=not mixtral,
    )


def replay_tensor(rollouts: Sequence[Rollout], width: int) -> torch.Tensor:
    """Ids [N, width, MoE layers, top_k] (int16, as recorded: a quarter of int64's memory) for
    right-padded sequences of `width` positions; -1 where nothing was recorded."""
    first = rollouts[0].routed_experts
    if first is None or any(r.routed_experts is None for r in rollouts):
        raise InputError("routing replay needs routed_experts on every rollout")
    out = torch.full((len(rollouts), width, *first.shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(rollouts):
        out[i, : r.routed_experts.shape[0]] = r.routed_experts
    return out


@dataclass
class ReplayBatch(Batch):
    """A `Batch` that carries the recorded routing of its rows (sliced with them by `select`)."""

    routed_experts: torch.Tensor | None = None
    """[N, L, MoE layers, top_k] int16, aligned with `input_ids`; -1: not recorded."""

    def select(self, rows: torch.Tensor | slice) -> ReplayBatch:
        return ReplayBatch(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))

    @classmethod
    def build(
        cls, rollouts: list[Rollout], advantages: torch.Tensor, device: torch.device
    ) -> ReplayBatch:
        batch = Batch.build(rollouts, advantages, device)
        fields = [getattr(batch, f) for f in Batch.__dataclass_fields__]
        routed = replay_tensor(rollouts, batch.input_ids.shape[1]).to(device)
        return cls(*fields, routed_experts=routed)


def build_batch(rollouts: list[Rollout], advantages: torch.Tensor, device: torch.device) -> Batch:
    """A `ReplayBatch` when the rollouts carry routing, else a plain `Batch`."""
    if rollouts and rollouts[0].routed_experts is not None:
        return ReplayBatch.build(rollouts, advantages, device)
    return Batch.build(rollouts, advantages, device)


@contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor | None) -> Iterator[None]:
    """While active, every MoE router of `model` takes its top-k ids from `routed` [N, L, layers,
    k] for a forward over N sequences of L tokens (None: a no-op)."""
    if routed is None:
        yield
        return
    routers, rule = moe_routers(model), routing_rule(model)
    if len(routers) != routed.shape[2] or rule.top_k != routed.shape[3]:
        raise InputError(
            f"recorded routing has {routed.shape[2]} MoE layers x top-{routed.shape[3]}; the "
            f"model has {len(routers)} x top-{rule.top_k}"
        )

    def hook(index: int):
        def replace(module, args, output):
            logits, _, ids = output
            tokens = logits.shape[0]
            width = tokens // routed.shape[0]
            given = routed[:, :width, index].reshape(tokens, -1).to(ids.device, torch.long)
            use = given[:, :1] >= 0
            new_ids = torch.where(use, given, ids)
            return logits, replay_weights(logits, new_ids, rule), new_ids

        return replace

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
