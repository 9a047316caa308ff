"""Streaming safetensors loading and the Hugging Face name -> engine parameter mapping.

The same `WeightMap` serves checkpoint loading (`load`) and a trainer's per-step weight update
(`update`): a HF tensor name resolves to a `Target` (engine module, shard of a fused layer, weight
or bias) and `update_tensor` writes it in place, re-quantizing with fresh scales. Per layer i:

| Hugging Face name (``model.layers.i.`` ...) | decoder module (``layers.i.`` ...) | shard |
|---------------------------------------------|------------------------------------|-------|
| self_attn.{q,k,v}_proj.{weight,bias}        | self_attn.qkv_proj                 | 0,1,2 |
| self_attn.o_proj.{weight,bias}              | self_attn.o_proj                   |       |
| self_attn.{q,k}_norm.weight                 | same (Qwen3)                       |       |
| mlp.{gate,up}_proj.{weight,bias}            | mlp.gate_up_proj                   | 0,1   |
| mlp.down_proj.{weight,bias}                 | mlp.down_proj                      |       |
| {input,post_attention}_layernorm.weight     | same                               |       |

``model.norm.weight``, ``model.embed_tokens.weight`` and ``lm_head.weight`` map to the decoder's
``norm``, ``embed_tokens`` and ``lm_head``. MoE layers: `flashrl.model.moe_weights` (per-expert
checkpoint names and the fused 3-D names of a `transformers` model in memory).

With tied embeddings `lm_head.weight` is optional and `model.embed_tokens.weight` also feeds the
head (a separate fp32 copy when `lm_head_fp32`). `*.rotary_emb.inv_freq` buffers are ignored.

Validation (`WeightMap.check`) runs before anything is written and refuses a tensor with a
`WeightError` naming it: an unknown name, something that is not a dense tensor, a dtype other than
float32 / bfloat16 / float16 / float64, a meta tensor, a wrong shape, or any NaN / Inf value (two
reductions, amax and amin, which NaN and Inf reach; no copy of the tensor). Damaged checkpoint files
raise a `CheckpointError` naming the file.
"""

from __future__ import annotations

import difflib
import json
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from flashrl.errors import CheckpointError, WeightError
from flashrl.model.decoder import GATE_UP_SHARDS, QKV_SHARDS, Decoder
from flashrl.model.moe_weights import Target, moe_names
from flashrl.model.weight_changes import ChangeCounts
from flashrl.quant.experts import QuantExperts
from flashrl.quant.linear import QuantLinear
from flashrl.quant.stochastic import round_to_dtype
from flashrl.utils import synchronize

IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_FUSED = {name: ("self_attn.qkv_proj", i) for i, name in enumerate(QKV_SHARDS)} | {
    name: ("mlp.gate_up_proj", i) for i, name in enumerate(GATE_UP_SHARDS)
}
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""What a weight update or checkpoint tensor may hold (float8 codes and integers are refused)."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards an index names."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _index_shards(index)
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if found:
        return [path / name for name in found]
    raise FileNotFoundError(
        f"{path} has no safetensors weights (expected model.safetensors or "
        "model.safetensors.index.json); PyTorch .bin checkpoints are not supported, convert them "
        "with save_pretrained(safe_serialization=True)"
    )


def _index_shards(index: Path) -> list[Path]:
    """The shard files `index` (model.safetensors.index.json) names, checked to exist."""
    try:
        raw = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index} is not valid JSON ({err})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f'{index} must be a JSON object whose "weight_map" maps tensor names to shard files'
        )
    files = [index.parent / s for s in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index} names shard file(s) that do not exist: {', '.join(missing)}"
        )
    return files


def iter_checkpoint_files(model_dir: str | Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, name, tensor) one tensor at a time, file by file (peak memory: one tensor). A
    file that is empty, truncated or not safetensors raises a `CheckpointError` naming it."""
    for file in checkpoint_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    yield file, name, tensor
        except (
            SafetensorError
        ) as err:  # header: empty, truncated, not safetensors; data: out of bounds
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({err}); re-save or re-download it"
            ) from None


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, file by file (peak memory: one tensor)."""
    for _, name, tensor in iter_checkpoint_files(model_dir):
        yield name, tensor


class WeightMap:
    """HF name -> engine target for one `Decoder`; validates names and shapes, applies tensors."""

    def __init__(self, model: Decoder, sync_generator: torch.Generator | None = None) -> None:
        self.model = model
        self.sync_generator = sync_generator
        """Stochastic rounding of everything stored, loads included (None: nearest): a resumed run
        loads the trainer's fp32 weights, and nearest rounding of those is the lag again."""
        self.modules = dict(model.named_modules())
        self.moe = moe_names(model.config)
        self.expected = self._expected_names()

    def _expected_names(self) -> set[str]:
        c = self.model.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        names |= {name for name, entry in self.moe.items() if not entry.covers}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        sparse = set(c.moe.sparse_layers) if c.moe is not None else set()
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names |= {
                p + "input_layernorm.weight",
                p + "post_attention_layernorm.weight",
                p + "self_attn.o_proj.weight",
            }
            names |= {p + f"self_attn.{s}.weight" for s in QKV_SHARDS}
            if i not in sparse:
                names |= {p + f"mlp.{s}.weight" for s in GATE_UP_SHARDS}
                names.add(p + "mlp.down_proj.weight")
            if c.qkv_bias:
                names |= {p + f"self_attn.{s}.bias" for s in QKV_SHARDS}
                if c.o_proj_bias:
                    names.add(p + "self_attn.o_proj.bias")
            if c.mlp_bias and i not in sparse:
                names |= {p + f"mlp.{s}.bias" for s in GATE_UP_SHARDS} | {p + "mlp.down_proj.bias"}
            if c.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names

    def resolve(self, name: str) -> list[Target]:
        """The decoder target(s) of HF tensor `name`; a `WeightError` naming it when unknown."""
        if isinstance(name, str) and name in self.moe:
            return [self.moe[name].target]
        if not isinstance(name, str) or (
            name not in self.expected
            and not (name == "lm_head.weight" and self.model.config.tie_word_embeddings)
        ):
            close = (
                difflib.get_close_matches(name, sorted(self.expected), n=3)
                if isinstance(name, str)
                else []
            )
            hint = f"; similar expected names: {', '.join(close)}" if close else ""
            raise WeightError(
                f"unexpected tensor {name!r} for a {self.model.config.family} model "
                f"({self.model.config.num_layers} layers){hint}"
            )
        module, _, kind = name.rpartition(".")
        if name == "model.embed_tokens.weight":
            targets = [Target("embed_tokens", "param")]
            if (
                self.model.config.tie_word_embeddings
                and self.model.lm_head.weight is not self.model.embed_tokens.weight
            ):
                targets.append(Target("lm_head", "weight"))
            return targets
        engine_module = module.removeprefix(
            "model."
        )  # the engine's modules carry no "model." prefix
        parent, _, leaf = engine_module.rpartition(".")
        if leaf in _FUSED:
            fused, shard = _FUSED[leaf]
            return [Target(f"{parent.rpartition('.')[0]}.{fused}", kind, shard)]
        if leaf.endswith("norm"):
            return [Target(engine_module, "param")]
        return [Target(engine_module, kind)]

    def _module(self, target: Target) -> torch.nn.Module:
        return self.modules[target.module]

    def check(self, name: str, tensor: torch.Tensor, finite: bool = True) -> list[Target]:
        """Resolve `name` and validate `tensor` for it without writing anything: a dense tensor of a
        `WEIGHT_DTYPES` dtype, not on the meta device, of the target's shape and (with `finite`)
        without NaN or Inf. Raises a `WeightError` naming the tensor and what is allowed."""
        targets = self.resolve(name)
        if not isinstance(tensor, torch.Tensor):
            raise WeightError(
                f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}"
            )
        if tensor.layout != torch.strided:
            raise WeightError(
                f"tensor {name!r} has layout {tensor.layout}; only dense (strided) "
                "tensors are allowed"
            )
        if tensor.dtype not in WEIGHT_DTYPES:
            raise WeightError(
                f"tensor {name!r} has dtype {tensor.dtype}; "
                "allowed: float32, bfloat16, float16 or float64"
            )
        if tensor.is_meta:
            raise WeightError(
                f"tensor {name!r} is on the meta device (it has no data); send materialised tensors"
            )
        for target in targets:
            expected = self.expected_shape(target)
            if tuple(tensor.shape) != expected:
                raise WeightError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}; expected {expected}"
                )
        if finite:
            check_finite(name, tensor)
        return targets

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape HF tensor `name` must have (a `WeightError` when the name is unknown)."""
        return self.expected_shape(self.resolve(name)[0])

    def expected_shape(self, target: Target) -> tuple[int, ...]:
        """The shape of what `target` receives: a whole parameter, or one shard's rows."""
        module = self._module(target)
        if target.kind == "param":
            return tuple(module.weight.shape)
        if target.kind in ("expert", "experts"):
            return module.update_shape(target.expert, target.shard)
        rows = module.out_features if target.shard is None else module.shard_sizes[target.shard]
        return (rows, module.in_features) if target.kind == "weight" else (rows,)

    @torch.no_grad()
    def update_tensor(
        self,
        name: str,
        tensor: torch.Tensor,
        count_changed: bool = False,
        checked: bool = False,
        counts: ChangeCounts | None = None,
        generator: torch.Generator | None = None,
    ) -> int:
        """Update one HF tensor of the decoder in place (validated first unless `checked`: the
        caller ran `check` on it); with `count_changed`, returns how many quantized codes changed
        (0 for layers kept in high precision). `counts`, when given, also counts the stored
        elements that changed, quantized and high-precision apart. With a `generator`, weights are
        rounded stochastically to their stored grid (`flashrl.quant.stochastic`; biases and MoE
        experts excepted, see `Engine`)."""
        changed = 0
        for target in self.resolve(name) if checked else self.check(name, tensor):
            module = self._module(target)
            quantized = isinstance(module, QuantLinear | QuantExperts)
            count = (count_changed and quantized) or counts is not None
            if target.kind == "param":
                old = module.weight.clone() if counts is not None else None
                if generator is not None:  # else copy_ rounds to nearest as it casts, no temporary
                    tensor = round_to_dtype(tensor, module.weight.dtype, generator)
                module.weight.copy_(tensor)
                n = int((old != module.weight).sum()) if old is not None else 0
            elif target.kind in ("expert", "experts"):
                n = module.requantize_(tensor, target.expert, target.shard, count)
            elif target.kind == "weight":
                n = module.requantize_(
                    tensor, shard=target.shard, count_changed=count, generator=generator
                )
            else:
                module.set_bias_(tensor.to(module.bias.dtype), shard=target.shard)
                continue
            if counts is not None:
                counts.add(quantized, n, tensor.numel())
            if quantized:
                changed += n
        return changed

    @torch.no_grad()
    def update(
        self,
        items: list[tuple[str, torch.Tensor]],
        device: torch.device,
        count_changed: bool = False,
        counts: ChangeCounts | None = None,
    ) -> tuple[float, float, int]:
        """`update_tensor` for each tensor `check` accepted, copied to `device` first; returns
        seconds copying, seconds re-quantizing (writing, for unquantized layers) and, with
        `count_changed`, the quantized codes that changed (`counts`: see `update_tensor`). A
        device failure (e.g. out of memory) gets a note saying how far it got."""
        transfer = requant = 0.0
        changed = 0
        for done, (name, tensor) in enumerate(items):
            t0 = time.perf_counter()
            try:
                on_device = tensor.detach().to(device, non_blocking=True)
                synchronize(device)
                t1 = time.perf_counter()
                changed += self.update_tensor(
                    name,
                    on_device,
                    count_changed=count_changed,
                    checked=True,
                    counts=counts,
                    generator=self.sync_generator,
                )
                synchronize(device)
            except Exception as err:  # validated, so only the device can fail here
                err.add_note(
                    f"update_weights failed at tensor {name!r} after writing {done} of "
                    f"{len(items)} tensors: the engine holds a partial update; send the "
                    "whole update again"
                )
                raise
            transfer += t1 - t0
            requant += time.perf_counter() - t1
        return transfer, requant, changed

    def quantized_codes(self) -> int:
        """How many quantized weight codes the model holds (the denominator of `count_changed`)."""
        return sum(
            m.weight.numel()
            for m in self.model.modules()
            if isinstance(m, QuantLinear | QuantExperts)
        )

    def random_weights(
        self, seed: int, std: float, dtype: torch.dtype, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every expected tensor drawn N(0, std) (norms 1) in `dtype` on `device`, in name order,
        from a generator on `device` seeded with `seed`."""
        gen = torch.Generator(device=device).manual_seed(seed)
        for name in sorted(self.expected):
            shape = self.shape_of(name)
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=dtype, device=device)
            else:
                tensor = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
                yield name, tensor.mul_(std).to(dtype)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Strict load of a whole checkpoint (`update_tensor` for each): unknown names raise at
        once, missing names at the end (a `CheckpointError`)."""
        self._load((None, name, tensor) for name, tensor in tensors)

    def load_checkpoint(self, model_dir: str | Path) -> None:
        """`load` from the safetensors files of `model_dir`; errors name the file and the tensor."""
        self._load(iter_checkpoint_files(model_dir), source=str(model_dir))

    def _load(
        self, items: Iterable[tuple[Path | None, str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        seen: set[str] = set()
        for file, name, tensor in items:
            if IGNORED.match(name):
                continue
            try:
                self.update_tensor(name, tensor, generator=self.sync_generator)
            except WeightError as err:
                raise WeightError(f"{file}: {err}" if file is not None else str(err)) from None
            seen.add(name)
            if name in self.moe:
                seen.update(self.moe[name].covers)
        missing = sorted(self.expected - seen)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise CheckpointError(
                f"{source} is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{more}"
            )


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise a `WeightError` if `tensor` holds NaN or Inf. amax and amin are two reductions without
    a temporary the size of the tensor; NaN propagates into both and an Inf is one of them, so the
    common (finite) path costs one small device-to-host copy. The full count runs only on
    failure."""
    if tensor.numel() == 0:
        return
    ends = torch.stack([tensor.amax(), tensor.amin()])
    if bool(torch.isfinite(ends).all()):
        return
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    raise WeightError(
        f"tensor {name!r} contains {count} non-finite value(s) (NaN or Inf), first "
        f"at index {first}; weights must be finite"
    )
