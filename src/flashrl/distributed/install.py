"""The worker side of a sync into a built-in `Engine`: validate the announced tensors, then write
each one in place as it arrives (re-quantizing a ``tensor``, copying ``codes`` and ``scale``)."""

from __future__ import annotations

import torch

from flashrl.distributed.transport import TensorMeta
from flashrl.errors import WeightError
from flashrl.quant.linear import QuantLinear

_FLOATS = ("float32", "bfloat16", "float16", "float64")


def quantized_names(engine) -> dict[str, str]:
    """HF weight name -> scheme name for every weight the engine stores as codes (what the trainer
    may quantize for it with ``run.weight_payload=codes``)."""
    out = {}
    for name in sorted(engine.weights.expected):
        targets = engine.weights.resolve(name)
        modules = [engine.weights.modules[t.module] for t in targets]
        if all(t.kind == "weight" for t in targets) and all(
            isinstance(m, QuantLinear) for m in modules
        ):
            out[name] = modules[0].scheme.name
    return out


def validate(engine, metas: list[TensorMeta], quantized: dict[str, str]) -> None:
    """A `WeightError` naming the first announced tensor the engine would refuse (unknown name,
    wrong shape or dtype), before any byte of the sync is received."""
    for m in metas:
        shape = engine.weights.shape_of(m.name)
        if m.kind == "tensor" and m.dtype not in _FLOATS:
            raise WeightError(f"tensor {m.name!r} has dtype {m.dtype}; allowed: {_FLOATS}")
        if m.kind in ("tensor", "codes") and m.shape != shape:
            raise WeightError(f"tensor {m.name!r} has shape {m.shape}; expected {shape}")
        if m.kind != "tensor" and m.name not in quantized:
            raise WeightError(f"{m.name!r} arrived as {m.kind} but is not quantized here")


class EngineSink:
    """Writes the tensors of one sync into `engine` as they complete."""

    def __init__(self, engine) -> None:
        self.engine, self.codes = engine, {}

    @torch.no_grad()
    def __call__(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        e = self.engine
        if meta.kind == "tensor":
            e.weights.apply(meta.name, tensor.to(e.device), checked=True)
        elif meta.kind == "codes":
            self.codes[meta.name] = tensor
        else:
            install_codes(e, meta.name, self.codes.pop(meta.name), tensor)


def install_codes(engine, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy trainer-side codes and scales of HF weight `name` into its (shard of a) QuantLinear,
    exactly where `QuantLinear.requantize_` would have written them."""
    for target in engine.weights.resolve(name):
        layer = engine.weights.modules[target.module]
        shard = target.shard
        start, end = layer.shard_rows(shard) if shard is not None else (0, layer.out_features)
        layer.weight[start:end].copy_(codes)
        if layer.scheme.weight_granularity == "channel":
            layer.weight_scale[start:end].copy_(scale)
        else:
            layer.weight_scale[shard or 0].copy_(scale)
            if layer.row_scale is not None:
                layer.row_scale[start:end].copy_(scale.expand(end - start))
