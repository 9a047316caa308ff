"""Streaming safetensors loading and the Hugging Face name -> engine parameter mapping.

The same `WeightMap` serves checkpoint loading and per-step weight sync from a trainer: a HF tensor
name resolves to a `Target` (engine module, which shard of a fused layer, weight or bias), and
`apply` writes it in place, re-quantizing quantized layers with fresh scales. Mapping (per layer i):

| Hugging Face name                                  | engine module                        | shard |
|----------------------------------------------------|--------------------------------------|-------|
| model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}| model.layers.i.self_attn.qkv_proj    | 0,1,2 |
| model.layers.i.self_attn.o_proj.{weight,bias}      | model.layers.i.self_attn.o_proj      |       |
| model.layers.i.self_attn.{q,k}_norm.weight         | same (Qwen3)                         |       |
| model.layers.i.mlp.{gate,up}_proj.{weight,bias}    | model.layers.i.mlp.gate_up_proj      | 0,1   |
| model.layers.i.mlp.down_proj.{weight,bias}         | model.layers.i.mlp.down_proj         |       |
| model.layers.i.{input,post_attention}_layernorm.weight, model.norm.weight, model.embed_tokens.weight, lm_head.weight | same | |

With tied embeddings `lm_head.weight` is optional and `model.embed_tokens.weight` also feeds the
head (a separate fp32 copy when `lm_head_fp32`). `*.rotary_emb.inv_freq` buffers are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from flashrl.engine.model import GATE_UP_SHARDS, QKV_SHARDS, Decoder
from flashrl.quant.linear import QuantLinear

IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_FUSED = {name: ("self_attn.qkv_proj", i) for i, name in enumerate(QKV_SHARDS)} | {
    name: ("mlp.gate_up_proj", i) for i, name in enumerate(GATE_UP_SHARDS)
}


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards an index names."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard file(s) that do not exist: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if found:
        return [path / name for name in found]
    raise FileNotFoundError(
        f"{path} has no safetensors weights (expected model.safetensors or model.safetensors.index.json); "
        f"PyTorch .bin checkpoints are not supported, convert them with save_pretrained(safe_serialization=True)"
    )


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, file by file (peak memory: one tensor)."""
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: `module` (engine name), `kind` ("weight", "bias", "param"), `shard`."""

    module: str
    kind: str
    shard: int | None = None


class WeightMap:
    """HF name -> engine target for one `Decoder`; validates names and shapes, applies tensors."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.modules = dict(model.named_modules())
        self.expected = self._expected_names()

    def _expected_names(self) -> set[str]:
        c = self.model.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"}
            names |= {p + f"self_attn.{s}.weight" for s in QKV_SHARDS} | {p + f"mlp.{s}.weight" for s in GATE_UP_SHARDS}
            names.add(p + "mlp.down_proj.weight")
            if c.qkv_bias:
                names |= {p + f"self_attn.{s}.bias" for s in QKV_SHARDS}
                if c.family == "llama":
                    names.add(p + "self_attn.o_proj.bias")
            if c.mlp_bias:
                names |= {p + f"mlp.{s}.bias" for s in GATE_UP_SHARDS} | {p + "mlp.down_proj.bias"}
            if c.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names

    def resolve(self, name: str) -> list[Target]:
        """The engine target(s) of HF tensor `name`; raises KeyError naming it when unknown."""
        if name not in self.expected and not (name == "lm_head.weight" and self.model.config.tie_word_embeddings):
            close = sorted(n for n in self.expected if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:])[:3]
            hint = f"; similar expected names: {', '.join(close)}" if close else ""
            raise KeyError(f"unexpected tensor {name!r} for a {self.model.config.family} model{hint}")
        module, _, kind = name.rpartition(".")
        if name == "model.embed_tokens.weight":
            targets = [Target("embed_tokens", "param")]
            if self.model.config.tie_word_embeddings and self.model.lm_head.weight is not self.model.embed_tokens.weight:
                targets.append(Target("lm_head", "weight"))
            return targets
        engine_module = module.removeprefix("model.")  # the engine's modules carry no "model." prefix
        parent, _, leaf = engine_module.rpartition(".")
        if leaf in _FUSED:
            fused, shard = _FUSED[leaf]
            return [Target(f"{parent.rpartition('.')[0]}.{fused}", kind, shard)]
        if leaf.endswith("norm"):
            return [Target(engine_module, "param")]
        return [Target(engine_module, kind)]

    def _module(self, target: Target) -> torch.nn.Module:
        return self.modules[target.module]

    def check(self, name: str, tensor: torch.Tensor) -> list[Target]:
        """Resolve `name` and check `tensor`'s shape and dtype against its target, without writing."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"tensor {name!r} must be a floating-point torch.Tensor, got "
                            f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        targets = self.resolve(name)
        for target in targets:
            expected = self._expected_shape(target)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; expected {expected}")
        return targets

    def _expected_shape(self, target: Target) -> tuple[int, ...]:
        module = self._module(target)
        if target.kind == "param":
            return tuple(module.weight.shape)
        rows = module.out_features if target.shard is None else module.shard_sizes[target.shard]
        return (rows, module.in_features) if target.kind == "weight" else (rows,)

    @torch.no_grad()
    def apply(self, name: str, tensor: torch.Tensor, count_changed: bool = False) -> int:
        """Write one HF tensor into the engine in place; with `count_changed`, returns how many
        quantized codes changed (0 for layers kept in high precision)."""
        changed = 0
        for target in self.check(name, tensor):
            module = self._module(target)
            if target.kind == "param":
                module.weight.copy_(tensor)
            elif target.kind == "weight":
                count = count_changed and isinstance(module, QuantLinear)
                changed += module.requantize_(tensor, shard=target.shard, count_changed=count)
            else:
                module.set_bias_(tensor.to(module.bias.dtype), shard=target.shard)
        return changed

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], progress: bool = False) -> None:
        """Strict load of a whole checkpoint: unknown names raise at once, missing names at the end."""
        seen: set[str] = set()
        for name, tensor in tensors:
            if IGNORED.match(name):
                continue
            self.apply(name, tensor)
            seen.add(name)
        missing = sorted(self.expected - seen)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise KeyError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{more}")
