"""Per-expert quantization errors of MoE layers for `flashrl profile`.

Each expert e of an MoE layer is measured like a dense layer, with one entry per checkpoint tensor:
``model.layers.L.mlp.experts.e.{gate_proj, up_proj, down_proj}``. The weight error is
``||W - deq(Q(W))|| / ||W||``. The output error is measured on the layer's calibration inputs (the
first `MAX_EXPERT_TOKENS` tokens, for cost), not only on the tokens routed to e, so every expert gets
a number on the same data whatever the routing. The down projection's input is the expert's own
bf16 SwiGLU output.
An expert quantizes exactly as a `QuantLinear` with its weight (tests/test_moe_experts.py), so this
is what the engine's `QuantExperts` does.

`engine_layer` is ``model.layers.L.mlp.experts``: all experts of a layer run under one scheme, and a
skip entry that names any of them keeps the whole layer's experts in bf16 (`flashrl.model.decoder`).
Routers (``mlp.gate``) and Qwen2-MoE's ``shared_expert_gate`` are never quantized, so they are not
profiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from flashrl.model.moe import MoEBlock
from flashrl.quant.experts import DenseExperts
from flashrl.quant.linear import DenseLinear

MAX_EXPERT_TOKENS = 2048
"""Tokens each expert is measured on (E experts x L layers x this many rows of GEMMs per scheme)."""
ShardErrors = Callable[[str, DenseLinear, torch.Tensor, Sequence[str]], list[dict[str, Any]]]


def is_router(name: str) -> bool:
    """Whether engine module `name` is an MoE router or shared-expert gate (never quantized)."""
    return name.endswith(".mlp.gate") or name.endswith(".shared_expert_gate")


def expert_linear(experts: DenseExperts, expert: int) -> DenseLinear:
    """Expert `expert`'s weight as a `DenseLinear` with the same shards (a view, no copy)."""
    w = experts.weight
    linear = DenseLinear(
        experts.in_features, experts.out_features, shard_sizes=experts.shard_sizes,
        dtype=w.dtype, device=w.device,
    )  # fmt: skip
    linear.weight = torch.nn.Parameter(w[expert], requires_grad=False)
    return linear


@torch.no_grad()
def expert_errors(
    name: str, block: MoEBlock, x: torch.Tensor, schemes: Sequence[str], measure: ShardErrors
) -> list[dict[str, Any]]:
    """The entries of every expert of MoE block `name` (engine name ``layers.L.mlp``) on the
    layer's inputs `x` [tokens, hidden]; `measure` is the dense layers' per-shard measurement."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    if not isinstance(gate_up, DenseExperts):  # the profile's reference engine is bf16
        return []
    inter = gate_up.out_features // 2
    x = x[:MAX_EXPERT_TOKENS]
    entries: list[dict[str, Any]] = []
    for e in range(gate_up.num_experts):
        first = expert_linear(gate_up, e)
        hidden = first(x)
        act = F.silu(hidden[:, :inter]) * hidden[:, inter:]
        second = expert_linear(down, e)
        for leaf, layer, inputs in (("gate_up_proj", first, x), ("down_proj", second, act)):
            for entry in measure(f"{name}.experts.{e}.{leaf}", layer, inputs, schemes):
                entry["engine_layer"] = f"model.{name}.experts"
                entry["expert"] = e
                entries.append(entry)
    return entries
