"""Hugging Face names of an MoE layer's tensors -> decoder targets (used by `WeightMap`).

Two naming conventions arrive and both are accepted, in any order and grouping (``L``: a sparse
layer, ``e``: an expert, ``B``: ``mlp``, or ``block_sparse_moe`` for Mixtral checkpoints):

| Hugging Face name (``model.layers.L.`` ...)    | shape      | decoder (``layers.L.mlp.``)     |
|------------------------------------------------|------------|---------------------------------|
| B.experts.e.{gate,up}_proj.weight (w1, w3)     | [I, H]     | experts.gate_up_proj, e, shard  |
| B.experts.e.down_proj.weight (Mixtral: w2)     | [H, I]     | experts.down_proj, expert e     |
| mlp.experts.gate_up_proj (in memory)           | [E, 2I, H] | experts.gate_up_proj, all       |
| mlp.experts.down_proj (in memory)              | [E, H, I]  | experts.down_proj, all          |
| B.gate.weight (and mlp.gate.weight, Mixtral)   | [E, H]     | gate (the router)               |
| mlp.shared_expert.{gate,up,down}_proj.weight   |            | shared_expert (Qwen2-MoE)       |
| mlp.shared_expert_gate.weight                  | [1, H]     | shared_expert_gate (Qwen2-MoE)  |

Checkpoints (`save_pretrained` of transformers 5.x) hold the per-expert names; a trainer's
`named_parameters()` holds the fused 3-D ones, whose rows [0, I) are gate and [I, 2I) up (the
layout `transformers` checks when it loads a per-expert checkpoint: tests/test_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashrl.model.config import ModelConfig


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: `module` (decoder name), `kind` ("weight", "bias", "param",
    "expert": one expert's rows, "experts": every expert's), `shard` of a fused layer, `expert`."""

    module: str
    kind: str
    shard: int | None = None
    expert: int | None = None


@dataclass(frozen=True)
class MoEName:
    """A MoE tensor name's target, and the checkpoint names it stands for when it is an alias
    (a fused in-memory name covers all its per-expert names); empty for a checkpoint name."""

    target: Target
    covers: tuple[str, ...] = ()


def moe_names(config: ModelConfig) -> dict[str, MoEName]:
    """Every accepted MoE tensor name of `config` (checkpoint names and aliases)."""
    moe = config.moe
    if moe is None:
        return {}
    names: dict[str, MoEName] = {}
    gate_name, up_name, down_name = moe.expert_names
    for layer in moe.sparse_layers:
        hf, block = f"model.layers.{layer}.", f"model.layers.{layer}.{moe.checkpoint_block}."
        mod = f"layers.{layer}.mlp."
        gate_up, down = mod + "experts.gate_up_proj", mod + "experts.down_proj"
        fused_gate_up, fused_down = [], []
        for e in range(moe.num_experts):
            for shard, leaf in enumerate((gate_name, up_name)):
                name = f"{block}experts.{e}.{leaf}.weight"
                names[name] = MoEName(Target(gate_up, "expert", shard, e))
                fused_gate_up.append(name)
            name = f"{block}experts.{e}.{down_name}.weight"
            names[name] = MoEName(Target(down, "expert", None, e))
            fused_down.append(name)
        names[hf + "mlp.experts.gate_up_proj"] = MoEName(
            Target(gate_up, "experts"), tuple(fused_gate_up)
        )
        names[hf + "mlp.experts.down_proj"] = MoEName(Target(down, "experts"), tuple(fused_down))
        router = Target(mod + "gate", "weight")
        names[block + "gate.weight"] = MoEName(router)
        if moe.checkpoint_block != "mlp":
            names[hf + "mlp.gate.weight"] = MoEName(router, (block + "gate.weight",))
        if moe.shared_expert_intermediate_size:
            shared = mod + "shared_expert."
            for shard, leaf in enumerate(("gate_proj", "up_proj")):
                target = Target(shared + "gate_up_proj", "weight", shard)
                names[f"{hf}mlp.shared_expert.{leaf}.weight"] = MoEName(target)
            names[hf + "mlp.shared_expert.down_proj.weight"] = MoEName(
                Target(shared + "down_proj", "weight")
            )
            names[hf + "mlp.shared_expert_gate.weight"] = MoEName(
                Target(mod + "shared_expert_gate", "weight")
            )
    return names
