"""`MoEConfig`: the mixture-of-experts fields of a Hugging Face ``config.json``, validated.

| architecture          | experts key                        | top-k weights                  |
|-----------------------|------------------------------------|--------------------------------|
| `Qwen3MoeForCausalLM` | `num_experts` / `num_local_experts`| softmax, top-k, norm_topk_prob |
| `Qwen2MoeForCausalLM` | `num_experts`, plus a shared expert| softmax, top-k, norm_topk_prob |
| `MixtralForCausalLM`  | `num_local_experts`                | softmax, top-k, normalised     |

Which layers are sparse (Qwen families): layer i is an MoE layer when ``(i + 1) %
decoder_sparse_step == 0`` and i is not in `mlp_only_layers`, as in `transformers`; Mixtral layers
are all sparse. The rules follow the installed `transformers` 5.x modeling files (docs/moe.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from flashrl.errors import ConfigError

MoELayout = Literal["qwen", "qwen_shared", "mixtral"]
"""``qwen``: Qwen3-MoE; ``qwen_shared``: Qwen2-MoE, plus a shared expert; ``mixtral``: Mixtral
(`flashrl.model.config.FAMILIES` says which family has which)."""


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert shapes of one MoE model (see the module table)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    """Indices of the decoder layers whose MLP is a sparse MoE block."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (0: none), gated by ``sigmoid(shared_expert_gate(x))``."""
    weights_in_router_dtype: bool = True
    """Qwen: the top-k weights are cast to the router logits' dtype before they scale the expert
    outputs; Mixtral keeps them fp32 (`transformers` does the same)."""
    checkpoint_block: str = "mlp"
    """The module name of the MoE block in checkpoints: ``mlp`` (Qwen) or ``block_sparse_moe``
    (Mixtral, whose in-memory `transformers` model calls it ``mlp``)."""

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """Checkpoint names of an expert's gate, up and down projections."""
        if self.checkpoint_block == "block_sparse_moe":
            return ("w1", "w3", "w2")
        return ("gate_proj", "up_proj", "down_proj")


def _int(raw: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 2**20:
        raise ConfigError(f"{source}: {key}={value!r} is invalid; allowed: an integer in [1, 2^20]")
    return value


def parse_moe(
    raw: dict[str, Any],
    layout: MoELayout | None,
    num_layers: int,
    intermediate_size: int,
    source: str,
) -> MoEConfig | None:
    """The `MoEConfig` of a family with MoE `layout` (None for a dense family); `ConfigError` on
    a bad field."""
    if layout is None:
        return None
    key = "num_local_experts" if layout == "mixtral" or "num_experts" not in raw else "num_experts"
    num_experts = _int(raw, key, source)
    top_k = _int(raw, "num_experts_per_tok", source)
    if top_k > num_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} is invalid; "
            f"allowed: at most {key}={num_experts}"
        )
    if layout == "mixtral":
        return MoEConfig(
            num_experts,
            top_k,
            intermediate_size,
            norm_topk_prob=True,
            sparse_layers=tuple(range(num_layers)),
            weights_in_router_dtype=False,
            checkpoint_block="block_sparse_moe",
        )
    step = _int(raw, "decoder_sparse_step", source, default=1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(
            f"{source}: mlp_only_layers={dense!r} is invalid; allowed: a list of layer indices"
        )
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"{source}: norm_topk_prob={norm!r} is invalid; allowed: true or false")
    shared = 0
    if layout == "qwen_shared":
        shared = _int(raw, "shared_expert_intermediate_size", source)
    return MoEConfig(
        num_experts,
        top_k,
        _int(raw, "moe_intermediate_size", source),
        norm_topk_prob=norm,
        sparse_layers=tuple(
            i for i in range(num_layers) if (i + 1) % step == 0 and i not in set(dense)
        ),
        shared_expert_intermediate_size=shared,
    )
