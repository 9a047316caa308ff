"""Delta update of the weights the workers keep unquantized (embeddings, norms, the LM head, layers on
the skip list): only the values that changed in the workers' storage dtype cross the wire.

The trainer rounds each such weight to the dtype the workers store it in (`dense_dtypes`, reported
by each worker; nearest rounding, what a worker's own cast of a full tensor does) and keeps that
rounded copy as its mirror. After the first update only the elements whose bits differ from the
mirror travel, as (flat index, new value) pairs; a weight whose pairs would outweigh it travels
whole, in the storage dtype (half the bytes of an fp32 trainer's tensor). The worker keeps the same
mirror, patches it, and writes the whole of it into the engine as a full update would (so the engine
stores exactly what a full update of the trainer's weights would have stored, ties and fused shards
included, and a stored value changed behind the update's back is overwritten at the next one).
Both sides checksum their mirrors (`flashrl.distributed.delta.checksum`). `diff_values` and
`apply_values_` also carry the int8 / fp8 codes of `flashrl.distributed.delta`: one bitwise diff
and one in-place write for every kind of weight.

At RL learning rates most bf16 values do not change from one step to the next (the bf16 lag of
issue 23: 1.4% changed per update on SmolLM2-135M at lr 1e-5), so the pairs are small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrl.errors import WeightError

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened and viewed as integers of its element size (compares bits, NaN-safe)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices where they reach every element, else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def diff_values(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices, new values) of the elements of `new` whose bits differ from `old`'s (int8 or
    fp8 codes and dense weights alike: compared and gathered as integers, exact for any dtype)."""
    bits = bit_view(new)
    index = (bit_view(old) != bits).nonzero().squeeze(1)
    return index.to(index_dtype(new.numel())), bits[index].view(new.dtype)


def apply_values_(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` at the flat `index` positions of contiguous `target`, in place (as integers
    of the element size, so fp8 codes need no float8 indexing kernel)."""
    if values.numel() != index.numel():
        raise WeightError(f"a delta has {index.numel()} indices and {values.numel()} values")
    if values.dtype != target.dtype:
        raise WeightError(f"a delta has {values.dtype} values; stored {target.dtype}")
    flat = bit_view(target)
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < flat.numel()):
        raise WeightError(f"a delta index is outside the {flat.numel()} values of the weight")
    flat[index.to(device=flat.device, dtype=torch.int64)] = bit_view(values).to(flat.device)


@dataclass
class DenseMirror:
    """What the workers store for one unquantized weight, as the trainer believes it."""

    value: torch.Tensor
    check: tuple[int, int, int, int]


def widest(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype that holds every one of `dtypes` exactly (a weight stored twice, e.g. a tied
    embedding with an fp32 LM head, travels in the wider)."""
    if len(set(dtypes)) == 1:
        return dtypes[0]
    return torch.float32 if all(d.itemsize <= 4 for d in dtypes) else torch.float64
