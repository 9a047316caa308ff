"""The worker side of an update into a built-in `Engine`: validate the announced tensors, then write
each one in place as it arrives (re-quantizing a ``tensor``, copying ``codes`` and ``scale``,
applying a delta's ``index`` / ``changed`` pairs to the stored codes), and checksum what is stored
(`stored_checksums`, compared with the trainer's after a delta update)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from flashrl.distributed.delta import Checksum, checksum
from flashrl.distributed.dense_delta import apply_values_, widest
from flashrl.distributed.transport import TensorMeta
from flashrl.errors import WeightError
from flashrl.quant.experts import QuantExperts
from flashrl.quant.linear import QuantLinear

_FLOATS = ("float32", "bfloat16", "float16", "float64")
_INDEX = ("int32", "int64")


def quantized_names(engine) -> dict[str, str]:
    """HF weight name -> scheme name for every weight the engine stores as codes (what the trainer
    may quantize for it with ``rollout.workers.payload=codes``)."""
    out = {}
    for name in sorted(engine.weights.expected):
        targets = engine.weights.resolve(name)
        modules = [engine.weights.modules[t.module] for t in targets]
        if all(t.kind == "weight" for t in targets) and all(
            isinstance(m, QuantLinear) for m in modules
        ):
            out[name] = modules[0].scheme.name
    return out


def dense_dtypes(engine) -> dict[str, str]:
    """HF weight name -> storage dtype for every weight the engine keeps unquantized (embeddings,
    norms, biases, the LM head, skipped layers; the widest where one is stored twice): what a delta
    update rounds those weights to on the trainer (`flashrl.distributed.dense_delta`)."""
    out = {}
    for name in sorted(engine.weights.expected):
        dtypes = []
        for target in engine.weights.resolve(name):
            module = engine.weights.modules[target.module]
            if isinstance(module, QuantLinear | QuantExperts):
                break
            dtypes.append((module.bias if target.kind == "bias" else module.weight).dtype)
        else:
            out[name] = str(widest(dtypes)).removeprefix("torch.")
    return out


def validate(
    engine, metas: list[TensorMeta], quantized: dict[str, str], dense: dict[str, str] | None = None
) -> None:
    """A `WeightError` naming the first announced tensor the engine would refuse (unknown name,
    wrong shape or dtype), before any byte of the update is received."""
    dense = dense or {}
    for m in metas:
        shape = engine.weights.shape_of(m.name)
        if m.kind == "tensor" and m.dtype not in _FLOATS:
            raise WeightError(f"tensor {m.name!r} has dtype {m.dtype}; allowed: {_FLOATS}")
        if m.kind in ("tensor", "codes") and m.shape != shape:
            raise WeightError(f"tensor {m.name!r} has shape {m.shape}; expected {shape}")
        if m.kind == "index" and (m.dtype not in _INDEX or len(m.shape) != 1):
            raise WeightError(f"delta index of {m.name!r} is {m.dtype} {m.shape}; expected 1-D int")
        if m.kind == "values" and (dense.get(m.name) != m.dtype or len(m.shape) != 1):
            raise WeightError(
                f"dense delta of {m.name!r} is {m.dtype} {m.shape}; expected 1-D "
                f"{dense.get(m.name, 'nothing: it is not stored unquantized here')}"
            )
        if m.kind in ("codes", "scale", "changed") and m.name not in quantized:
            raise WeightError(f"{m.name!r} arrived as {m.kind} but is not quantized here")
        if m.kind == "index" and m.name not in quantized and m.name not in dense:
            raise WeightError(f"{m.name!r} arrived as a delta but is not stored here")


class EngineSink:
    """Writes the tensors of one update into `engine` as they complete (a weight's ``codes`` or
    ``index`` / ``changed`` wait for its ``scale``, which comes last; a dense ``index`` waits for
    its ``values``). With a `mirror` (a delta update), the unquantized weights named in `dense` are
    kept there as received and patched by their deltas (`flashrl.distributed.dense_delta`)."""

    def __init__(
        self, engine, dense: dict[str, str] | None = None, mirror: dict | None = None
    ) -> None:
        self.engine, self.dense, self.mirror = engine, dense or {}, mirror
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        e = self.engine
        if meta.kind == "tensor" and self.mirror is not None and meta.name in self.dense:
            self.mirror[meta.name] = tensor.to(e.device, copy=True)
            e.weights.update_tensor(meta.name, self.mirror[meta.name], checked=True)
        elif meta.kind == "tensor":
            e.weights.update_tensor(meta.name, tensor.to(e.device), checked=True)
        elif meta.kind == "values":
            if self.mirror is None or meta.name not in self.mirror:
                raise WeightError(f"a dense delta of {meta.name!r} arrived before its whole value")
            index = self.parts.pop(meta.name)["index"]
            apply_values_(self.mirror[meta.name], index, tensor)
            e.weights.update_tensor(meta.name, self.mirror[meta.name], checked=True)
        elif meta.kind != "scale":
            self.parts.setdefault(meta.name, {})[meta.kind] = tensor
        else:
            parts = self.parts.pop(meta.name)
            if "codes" in parts:
                install_codes(e, meta.name, parts["codes"], tensor)
            else:
                apply_delta(e, meta.name, parts["index"], parts["changed"], tensor)


def _targets(engine, name: str) -> Iterator[tuple[Any, int, int, int | None]]:
    """(QuantLinear, first row, end row, shard) of each place HF weight `name` is stored."""
    for target in engine.weights.resolve(name):
        layer = engine.weights.modules[target.module]
        shard = target.shard
        start, end = layer.shard_rows(shard) if shard is not None else (0, layer.out_features)
        yield layer, start, end, shard


def _write_scale(layer, start: int, end: int, shard: int | None, scale: torch.Tensor) -> None:
    if layer.scheme.weight_granularity == "channel":
        layer.weight_scale[start:end].copy_(scale)
    else:
        layer.weight_scale[shard or 0].copy_(scale)
        if layer.row_scale is not None:
            layer.row_scale[start:end].copy_(scale.expand(end - start))


def install_codes(engine, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy trainer-side codes and scales of HF weight `name` into its (shard of a) QuantLinear,
    exactly where `QuantLinear.requantize_` would have written them."""
    for layer, start, end, shard in _targets(engine, name):
        layer.weight[start:end].copy_(codes)
        _write_scale(layer, start, end, shard, scale)


def apply_delta(
    engine, name: str, index: torch.Tensor, changed: torch.Tensor, scale: torch.Tensor
) -> None:
    """Write a delta (the `changed` codes at flat `index` positions of the weight's rows) and the
    new scales of HF weight `name` into its stored codes, in place."""
    if changed.numel() != index.numel():
        raise WeightError(f"delta of {name!r}: {index.numel()} indices, {changed.numel()} codes")
    for layer, start, end, shard in _targets(engine, name):
        if changed.dtype != layer.weight.dtype:
            raise WeightError(f"delta of {name!r} has {changed.dtype}; stored {layer.weight.dtype}")
        apply_values_(layer.weight[start:end], index, changed)
        _write_scale(layer, start, end, shard, scale)


def stored_codes(engine, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the codes and scales the engine stores for quantized HF weight `name`."""
    layer, start, end, shard = next(_targets(engine, name))
    channel = layer.scheme.weight_granularity == "channel"
    scale = layer.weight_scale[start:end] if channel else layer.weight_scale[shard or 0]
    return layer.weight[start:end], scale


def stored_checksums(engine, names: list[str]) -> dict[str, Checksum]:
    """`delta.checksum` of the codes and scales the engine stores for each quantized HF weight."""
    return {name: checksum(*stored_codes(engine, name)) for name in names}


def mirror_checksums(mirror: dict[str, torch.Tensor], names: list[str]) -> dict[str, Checksum]:
    """`delta.checksum` of the kept values of unquantized weights (`EngineSink`'s mirror)."""
    return {name: checksum(mirror[name], mirror[name][:0]) for name in names if name in mirror}
