"""Padded batches: right-padded token ids with their masks, and `ForwardBatch`, where the tokens of
one forward pass sit (positions, KV-cache slots, attention mask).

Every caller that feeds several sequences of different lengths to the decoder pads the same way,
through `pad_right`: ids ``[B, T]`` right-padded with 0, ``valid`` ``[B, T]`` True on real tokens.
Causal attention never lets a real token see the padding after it, so a padded prefill computes for
each real token what it computes alone; the logits of sequence b are read at ``lengths[b] - 1``.

The KV cache is anything with the `KVStore` methods (`flashrl.engine.kv_cache.KVCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

KVObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``observer(layer, q, k, v)``: sees q [B, heads, T, D] and k, v [B, kv_heads, T, D] after q/k
norm and RoPE, i.e. exactly what attention uses and the cache stores (FP8 KV calibration)."""


class KVStore(Protocol):
    """The KV cache as the decoder's attention uses it (layout: `flashrl.engine.kv_cache`)."""

    def write_prefill(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_decode(
        self,
        layer: int,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None: ...

    def read(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Padded:
    """Right-padded token sequences."""

    ids: torch.Tensor
    """[B, T] long, 0 after each sequence's end (T: the longest sequence)."""
    valid: torch.Tensor
    """[B, T] bool, True on real tokens."""
    lengths: torch.Tensor
    """[B] long, tokens per sequence."""

    @property
    def last(self) -> torch.Tensor:
        """[B] index of each sequence's last token (where its next-token logits are)."""
        return self.lengths - 1


def pad_right(sequences: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> Padded:
    """Stack token sequences into right-padded tensors on `device` (built on the host, one copy)."""
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : lengths[row]] = torch.as_tensor(seq, dtype=torch.long)
        valid[row, : lengths[row]] = True
    return Padded(ids.to(device), valid.to(device), torch.tensor(lengths).to(device))


def attention_mask(
    q_positions: torch.Tensor, kv_length: int, sliding_window: int | None
) -> torch.Tensor:
    """Mask [B, 1, T, S]: query at position p sees keys 0..p (only the last `sliding_window`)."""
    keys = torch.arange(kv_length, device=q_positions.device)
    q = q_positions[:, None, :, None]
    mask = keys <= q
    if sliding_window is not None:
        mask &= keys > q - sliding_window
    return mask


@dataclass
class ForwardBatch:
    """Where the tokens of one forward pass sit. `positions` [B, T]; for decode T == 1.

    - prefill: `slots` [B] receive the K/V of positions 0..T-1 (right-padded prompts; causal
      attention never lets a real token see the padding after it);
    - decode: the batch is slots 0..B-1, each writes one token at `positions[:, 0]` and attends
      over cache positions 0..kv_length-1 up to its own position;
    - no cache (`cache` None): a plain causal forward over the whole sequence (scoring, tests).

    Build one with `causal` (prefill or no cache) or `decode_step`.
    """

    positions: torch.Tensor
    cache: KVStore | None = None
    slots: torch.Tensor | None = None
    decode: bool = False
    kv_length: int = 0
    mask: torch.Tensor | None = None
    """Boolean attention mask [B or 1, 1, T, S] (True = attend); None means plain causal."""
    kv_observer: KVObserver | None = None
    """Called as ``kv_observer(layer, q, k, v)`` (see `KVObserver`)."""
    row_mask: torch.Tensor | None = None
    """Padded decode batches (shape bucketing): [B, 1, 1] in the activation dtype, 1 for real rows
    and 0 for padding rows. Every linear layer's input is multiplied by it, so padding rows enter
    each GEMM as exact zeros and cannot move a per-tensor activation scale (the `fp8` scheme's amax
    spans the batch); the cache counts clipping on real rows only. Multiplying by 1 is exact, so
    real rows compute what they compute unpadded. None: no padding rows."""

    @classmethod
    def causal(
        cls,
        positions: torch.Tensor,
        sliding_window: int | None,
        cache: KVStore | None = None,
        slots: torch.Tensor | None = None,
        kv_observer: KVObserver | None = None,
    ) -> ForwardBatch:
        """A causal forward over `positions` [B, T] (a prefill into `slots` of `cache`, or no
        cache); a mask only where the sliding window is shorter than the sequence."""
        width = positions.shape[1]
        mask = None
        if sliding_window is not None and width > sliding_window:
            mask = attention_mask(positions, width, sliding_window)
        return cls(
            positions=positions, cache=cache, slots=slots, mask=mask, kv_observer=kv_observer
        )

    @classmethod
    def prefill(
        cls,
        batch: int,
        width: int,
        device: torch.device | str,
        sliding_window: int | None,
        cache: KVStore | None = None,
        slots: torch.Tensor | None = None,
        kv_observer: KVObserver | None = None,
    ) -> ForwardBatch:
        """`causal` over positions 0..width-1 of `batch` right-padded sequences."""
        positions = torch.arange(width, device=device).expand(batch, width)
        return cls.causal(positions, sliding_window, cache, slots, kv_observer)

    @classmethod
    def decode_step(
        cls,
        positions: torch.Tensor,
        cache: KVStore,
        kv_length: int,
        sliding_window: int | None,
        row_mask: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """One decode step: row b (slot b) writes its token at `positions[b, 0]` and attends over
        cache positions 0..kv_length-1 up to its own."""
        mask = attention_mask(positions, kv_length, sliding_window)
        return cls(
            positions=positions,
            cache=cache,
            decode=True,
            kv_length=kv_length,
            mask=mask,
            row_mask=row_mask,
        )


def masked_rows(x: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
    """`x` [B, T, F] with the padding rows of a bucketed decode batch set to zero (see
    `ForwardBatch.row_mask`)."""
    return x if batch is None or batch.row_mask is None else x * batch.row_mask
