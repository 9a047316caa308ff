"""The KV cache: a fixed pool of sequence slots.

Layout: for every layer one K and one V tensor of shape

    [max_batch (slots), num_kv_heads, max_len, head_dim]

A sequence owns one slot; token t of that sequence lives at index t of the slot's `max_len` axis.
This is the layout scaled-dot-product attention reads directly (heads before positions), so a
decode step attends over ``k[:batch, :, :length]`` without copying. The engine keeps its active
sequences in slots ``0 .. batch-1`` (it moves the last sequence into a freed slot), so every step
works on a prefix of the pool.

Example (2 layers, 4 slots, 2 kv heads, 8 positions, head_dim 16): after prefilling a 3-token
prompt into slot 0 and decoding one token, ``k[layer][0, :, :4]`` holds its keys and positions 4..7
hold stale values that attention masks out.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (max_batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_batch, self.max_len, self.dtype = max_batch, max_len, dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one cached token costs across all layers (K and V)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ------------------------------------------------------------------ writes

    def write_prefill(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values [P, kv_heads, T, head_dim] of P prompts at positions 0..T-1 of `slots`."""
        length = k.shape[2]
        self.k[layer][slots, :, :length] = k
        self.v[layer][slots, :, :length] = v

    def write_decode(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one new token per active slot: k, v [B, kv_heads, head_dim] at `positions` [B] of
        slots 0..B-1."""
        batch = k.shape[0]
        rows = torch.arange(batch, device=k.device)
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    # ------------------------------------------------------------------ reads

    def read(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots 0..batch-1, positions 0..length-1 (views, no copy)."""
        return self.k[layer][:batch, :, :length], self.v[layer][:batch, :, :length]

    # ------------------------------------------------------------------ slot management

    def copy_slot(self, src: int, dst: torch.Tensor | list[int], length: int) -> None:
        """Copy the first `length` positions of slot `src` into slots `dst` (a prompt's n samples
        share one prefill)."""
        dst = torch.as_tensor(dst, device=self.k[0].device)
        for cache in self.k + self.v:
            cache[dst, :, :length] = cache[src, :, :length].unsqueeze(0)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a sequence from slot `src` to slot `dst` (compaction after a sequence finishes)."""
        for cache in self.k + self.v:
            cache[dst, :, :length] = cache[src, :, :length]
