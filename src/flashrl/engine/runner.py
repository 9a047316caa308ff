"""The model runner: the decoder's forwards over the slot KV cache, logits out.

- `prefill`: right-padded prompts into given slots (one forward), the next-token logits of each;
- `prefill_groups`: the same for the groups a scheduler admits, the prompt's K/V copied to the
  slots of its other samples (a GRPO group shares one prefill);
- `decode`: one token per active slot through `DecodeStep` (bucketed and compiled when asked,
  `flashrl.engine.decode`); `decode_eager` runs the exact shapes whatever the step's settings.

The runner owns the KV cache (`cache`), allocated at the first use (`ensure_cache`).

Sampling and scheduling are elsewhere (`flashrl.engine.sampler`, `flashrl.engine.scheduler`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashrl.engine.decode import DecodeStep
from flashrl.engine.kv_cache import KVCache
from flashrl.model.batch import ForwardBatch, pad_right
from flashrl.model.decoder import Decoder


class ModelRunner:
    """Runs `model` on `device` with a KV cache of `max_batch` slots of `max_len` positions, stored
    as `kv_cache_dtype` with fp8 scales at `scale_granularity` (`flashrl.engine.kv_cache`)."""

    def __init__(
        self,
        model: Decoder,
        max_batch: int,
        max_len: int,
        device: torch.device,
        decode_compile: str | None = None,
        decode_buckets: bool | None = None,
        kv_cache_dtype: str = "bf16",
        scale_granularity: str = "layer",
    ) -> None:
        self.model, self.device, self.max_batch, self.max_len = model, device, max_batch, max_len
        self.kv_cache_dtype, self.scale_granularity = kv_cache_dtype, scale_granularity
        buckets = decode_compile is not None if decode_buckets is None else decode_buckets
        self.decode = DecodeStep(
            model, max_batch, max_len, device, compile=decode_compile, buckets=buckets
        )
        self.cache: KVCache | None = None
        self.last_prefill: tuple[list[int], list[int]] = ([], [])
        """The latest `prefill_groups`: the prefill row of each returned logits row, and the
        prompt length of each prefill row (routing capture, `flashrl.engine.routing`)."""

    def ensure_cache(
        self, initial_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> KVCache:
        """The KV cache, allocated on first use with `initial_scales` (k, v) where it has static
        fp8 scales."""
        if self.cache is None:
            c = self.model.config
            self.cache = KVCache(
                c.num_layers,
                self.max_batch,
                c.num_kv_heads,
                self.max_len,
                c.head_dim,
                self.model.dtype,
                self.device,
                kv_cache_dtype=self.kv_cache_dtype,
                scale_granularity=self.scale_granularity,
            )
            if initial_scales is not None and self.cache.k_scale is not None:
                self.cache.set_scales(*initial_scales)
        return self.cache

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs (all layers, K and V, per-token scales included)."""
        c = self.model.config
        return KVCache.bytes_per_token(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.model.dtype,
            self.kv_cache_dtype,
            self.scale_granularity,
        )

    @torch.no_grad()
    def prefill(
        self, cache: KVCache, prompts: Sequence[Sequence[int]], slots: Sequence[int]
    ) -> torch.Tensor:
        """Prefill `prompts` (token ids) into cache `slots` in one right-padded forward; returns
        the fp32 logits [len(prompts), vocab] predicting each prompt's next token."""
        padded = pad_right(prompts, self.device)
        batch = ForwardBatch.prefill(
            len(prompts),
            padded.ids.shape[1],
            self.device,
            self.model.sliding_window,
            cache=cache,
            slots=torch.tensor(list(slots), device=self.device),
        )
        hidden = self.model.hidden_states(padded.ids, batch)
        last = hidden[torch.arange(len(prompts), device=self.device), padded.last]
        return self.model.logits(last)

    @torch.no_grad()
    def prefill_groups(
        self,
        cache: KVCache,
        prompts: Sequence[Sequence[int]],
        sizes: Sequence[int],
        first_slot: int,
    ) -> torch.Tensor:
        """Prefill one prompt per group into consecutive slots from `first_slot` on (group g takes
        `sizes[g]` slots; its prompt goes to the first, then its K/V is copied to the others);
        returns the logits [sum(sizes), vocab], one row per slot."""
        slots = [first_slot + sum(sizes[:g]) for g in range(len(sizes))]
        logits = self.prefill(cache, prompts, slots)
        for prompt, slot, size in zip(prompts, slots, sizes):
            if size > 1:
                cache.copy_slot(slot, list(range(slot + 1, slot + size)), len(prompt))
        rows = [g for g, size in enumerate(sizes) for _ in range(size)]
        self.last_prefill = (rows, [len(p) for p in prompts])
        return logits[torch.tensor(rows, device=self.device)]

    def decode_eager(self, cache: KVCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step at its exact shapes (never bucketed or compiled): slot b feeds
        `tokens[b]` at `positions[b]`; fp32 logits [B, vocab]."""
        return self.decode.eager(cache, tokens, positions)
