"""The KV cache: a fixed pool of sequence slots, stored in the activation dtype or as FP8 (e4m3).

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

``kv_cache_dtype="bf16"`` stores K and V in the engine's activation dtype (bf16 by default, fp32 in
an fp32 engine): the name is the config's, meaning "not quantized". With ``"fp8"`` the same layout
holds ``float8_e4m3fn`` codes (1 byte per value instead of 2) plus fp32 scales, at one of three
granularities:

- ``layer``: ``k_scale``, ``v_scale`` [num_layers, 1], set by calibration or a fixed value
  (`set_scales`);
- ``head``: ``k_scale``, ``v_scale`` [num_layers, kv_heads], the same with one scale per kv head;
- ``token``: ``k_token_scale[layer]`` [slots, kv_heads, max_len] (and v), set at every write: the
  amax of that token and head (no calibration, never clips).

    write:  codes = e4m3(clamp(k / s, -448, 448))     fp32 math, clamp before the cast, x / s
    read:   k ~= codes * s                            in fp32, cast to the activation dtype

Both directions go through `flashrl.quant.primitives` (the one definition of the fp8 rules). The
read is the CPU reference path: it dequantizes the slice attention needs; a fused CUDA kernel
would instead dequantize tiles in registers. Static scale buffers are written in place
(``copy_``), so their storage never moves (captured CUDA graphs keep pointing at them).

Clipping is counted on the device without a host sync: ``clipped`` is the number of values whose
``|x / s|`` exceeded 448 before the clamp, ``written`` the number of values quantized with a
static scale. A non-zero count means a scale was stale or too tight.
"""

from __future__ import annotations

import torch

from flashrl.core.config import KV_CACHE_DTYPES, KV_SCALE_GRANULARITIES
from flashrl.errors import ConfigError, InputError
from flashrl.quant.primitives import (
    dequantize_per_row,
    dequantize_per_tensor,
    encode_codes,
    quantize_per_row,
)
from flashrl.quant.schemes import FP8_E4M3_QMAX

FP8 = torch.float8_e4m3fn


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
        kv_cache_dtype: str = "bf16",
        scale_granularity: str = "layer",
    ) -> None:
        _check(kv_cache_dtype, scale_granularity)
        self.quantized = kv_cache_dtype == "fp8"
        self.kv_cache_dtype, self.scale_granularity = kv_cache_dtype, scale_granularity
        shape = (max_batch, num_kv_heads, max_len, head_dim)
        store = FP8 if self.quantized else dtype
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.max_batch, self.max_len, self.dtype = max_batch, max_len, dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.k_token_scale: list[torch.Tensor] = []
        self.v_token_scale: list[torch.Tensor] = []
        if self.quantized and scale_granularity == "token":
            self.k_token_scale = [
                torch.ones(shape[:3], dtype=torch.float32, device=device) for _ in range(num_layers)
            ]
            self.v_token_scale = [
                torch.ones(shape[:3], dtype=torch.float32, device=device) for _ in range(num_layers)
            ]
        elif self.quantized:
            groups = scale_groups(num_kv_heads, scale_granularity)
            self.k_scale = torch.ones(num_layers, groups, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(num_layers, groups, dtype=torch.float32, device=device)
        self.clipped = torch.zeros((), dtype=torch.int64, device=device)
        self.written = torch.zeros((), dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ memory accounting

    @staticmethod
    def bytes_per_token(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "bf16",
        scale_granularity: str = "layer",
    ) -> int:
        """Bytes one cached token costs across all layers (K and V), per-token scales included."""
        _check(kv_cache_dtype, scale_granularity)
        element = 1 if kv_cache_dtype == "fp8" else torch.empty((), dtype=dtype).element_size()
        per_value = num_kv_heads * head_dim * element
        if kv_cache_dtype == "fp8" and scale_granularity == "token":
            per_value += num_kv_heads * 4  # one fp32 scale per head
        return 2 * num_layers * per_value

    @staticmethod
    def fixed_bytes(
        num_layers: int,
        num_kv_heads: int,
        kv_cache_dtype: str = "bf16",
        scale_granularity: str = "layer",
    ) -> int:
        """Bytes that do not grow with the number of tokens: the static K and V scale buffers."""
        _check(kv_cache_dtype, scale_granularity)
        if kv_cache_dtype != "fp8" or scale_granularity == "token":
            return 0
        return 2 * num_layers * scale_groups(num_kv_heads, scale_granularity) * 4

    @classmethod
    def capacity_tokens(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "bf16",
        scale_granularity: str = "layer",
    ) -> int:
        """How many tokens (summed over all sequences) a cache of `budget_bytes` holds."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be >= 0")
        free = budget_bytes - cls.fixed_bytes(
            num_layers, num_kv_heads, kv_cache_dtype, scale_granularity
        )
        per_token = cls.bytes_per_token(
            num_layers, num_kv_heads, head_dim, dtype, kv_cache_dtype, scale_granularity
        )
        return max(0, free // per_token)

    def stats(self) -> dict[str, float]:
        """``kv_cache_bytes``; static fp8 scales: ``kv_{k,v}_scale_{mean,max}``; fp8:
        ``kv_clipped_values`` and ``kv_clipped_frac`` (of the values written with static scales)."""
        s = {"kv_cache_bytes": float(self.nbytes())}
        if self.k_scale is not None:
            k, v = self.k_scale, self.v_scale
            s.update(
                kv_k_scale_mean=float(k.mean()),
                kv_k_scale_max=float(k.max()),
                kv_v_scale_mean=float(v.mean()),
                kv_v_scale_max=float(v.max()),
            )
        if self.quantized:
            clipped, written = int(self.clipped), int(self.written)
            s["kv_clipped_values"] = float(clipped)
            s["kv_clipped_frac"] = clipped / written if written else 0.0
        return s

    def nbytes(self) -> int:
        """Bytes held by the cache: codes or values, and every scale buffer."""
        tensors = self.k + self.v + self.k_token_scale + self.v_token_scale
        tensors += [t for t in (self.k_scale, self.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ scales

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Overwrite the static scales in place (storage unchanged). Shapes [num_layers, groups] or
        anything that broadcasts to it (a scalar sets every layer)."""
        if self.k_scale is None:
            raise ValueError(
                "set_scales needs an fp8 cache with layer or head scales; this cache is "
                f"kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"scale_granularity={self.scale_granularity!r}"
            )
        for name, new, buf in (
            ("k_scale", k_scale, self.k_scale),
            ("v_scale", v_scale, self.v_scale),
        ):
            new = torch.as_tensor(new, dtype=torch.float32, device=buf.device)
            if not bool(torch.isfinite(new).all()) or not bool((new > 0).all()):
                raise InputError(
                    f"{name} must be finite and positive, got {new.flatten()[:8].tolist()}"
                )
            buf.copy_(new.expand_as(buf))

    # ------------------------------------------------------------------ writes

    def _quantize(
        self, x: torch.Tensor, scale: torch.Tensor | None, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp8 codes of `x` [B, heads, (T,) head_dim] (and per-token scales in token mode). `valid`
        [B] (nonzero = real row) limits the clipping counters to real rows of a padded batch."""
        if scale is None:  # token granularity: one scale per (token, head), the row amax
            codes, token_scale = quantize_per_row(
                x.reshape(-1, x.shape[-1]), FP8, check_finite=False
            )
            return codes.view(x.shape), token_scale.view(x.shape[:-1])
        groups = scale.view((-1,) + (1,) * (x.dim() - 2))  # per head (or one) over [heads, (T,) D]
        scaled = x.float() / groups
        clipped = scaled.abs() > FP8_E4M3_QMAX
        if valid is None:
            self.clipped += torch.count_nonzero(clipped)
            self.written += scaled.numel()
        else:
            real = (valid != 0).view((-1,) + (1,) * (x.dim() - 1))
            self.clipped += torch.count_nonzero(clipped & real)
            self.written += torch.count_nonzero(real) * (scaled.numel() // x.shape[0])
        codes = torch.empty(x.shape, dtype=FP8, device=x.device)
        return encode_codes(scaled, FP8, codes), None

    def write_prefill(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [P, kv_heads, T, head_dim] of P prompts at positions 0..T-1 of `slots`.
        Returns them as stored: `k`, `v` themselves, or their dequantized fp8 codes (what the
        prefill's attention must use, so that it sees what later decode steps will read)."""
        length = k.shape[2]
        if not self.quantized:
            self.k[layer][slots, :, :length] = k
            self.v[layer][slots, :, :length] = v
            return k, v
        stored = []
        for codes_buf, token_buf, scale, x in self._parts(layer, k, v):
            codes, token_scale = self._quantize(x, scale)
            codes_buf[slots, :, :length] = codes
            if token_scale is not None:
                token_buf[slots, :, :length] = token_scale
                stored.append(dequantize_per_row(codes, token_scale.unsqueeze(-1), self.dtype))
            else:
                stored.append(dequantize_per_tensor(codes, scale.view(-1, 1, 1), self.dtype))
        return stored[0], stored[1]

    def write_decode(
        self,
        layer: int,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Store one new token per active slot: k, v [B, kv_heads, head_dim] at `positions` [B] of
        slots 0..B-1. `valid` [B] marks the real rows of a padded (bucketed) decode batch: padding
        rows write into their own free slots like any row (the engine gives them position 0 of a
        slot no sequence owns) but are left out of the ``clipped`` / ``written`` counters."""
        rows = torch.arange(k.shape[0], device=k.device)
        if not self.quantized:
            self.k[layer][rows, :, positions] = k
            self.v[layer][rows, :, positions] = v
            return
        for codes_buf, token_buf, scale, x in self._parts(layer, k, v):
            codes, token_scale = self._quantize(x, scale, valid)
            codes_buf[rows, :, positions] = codes
            if token_scale is not None:
                token_buf[rows, :, positions] = token_scale

    def _parts(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        token = self.scale_granularity == "token"
        yield (
            self.k[layer],
            self.k_token_scale[layer] if token else None,
            None if token else self.k_scale[layer],
            k,
        )
        yield (
            self.v[layer],
            self.v_token_scale[layer] if token else None,
            None if token else self.v_scale[layer],
            v,
        )

    # ------------------------------------------------------------------ reads

    def read(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots 0..batch-1, positions 0..length-1: views without quantization,
        dequantized copies in the activation dtype with fp8."""
        k, v = self.k[layer][:batch, :, :length], self.v[layer][:batch, :, :length]
        if not self.quantized:
            return k, v
        if self.scale_granularity == "token":
            ks = self.k_token_scale[layer][:batch, :, :length].unsqueeze(-1)
            vs = self.v_token_scale[layer][:batch, :, :length].unsqueeze(-1)
            return dequantize_per_row(k, ks, self.dtype), dequantize_per_row(v, vs, self.dtype)
        ks, vs = self.k_scale[layer].view(-1, 1, 1), self.v_scale[layer].view(-1, 1, 1)
        return dequantize_per_tensor(k, ks, self.dtype), dequantize_per_tensor(v, vs, self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns (codes or values, scales, counters): the decode step's state,
        which a captured CUDA graph reads and writes at fixed addresses."""
        scales = [t for t in (self.k_scale, self.v_scale) if t is not None]
        return self._per_slot() + scales + [self.clipped, self.written]

    # ------------------------------------------------------------------ slot management

    def _per_slot(self) -> list[torch.Tensor]:
        return self.k + self.v + self.k_token_scale + self.v_token_scale

    def copy_slot(self, src: int, dst: torch.Tensor | list[int], length: int) -> None:
        """Copy the first `length` positions of slot `src` into slots `dst` (a prompt's n samples
        share one prefill)."""
        dst = torch.as_tensor(dst, device=self.k[0].device)
        for cache in self._per_slot():
            cache[dst, :, :length] = cache[src, :, :length].unsqueeze(0)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a sequence from slot `src` to slot `dst` (compaction after a sequence finishes)."""
        for cache in self._per_slot():
            cache[dst, :, :length] = cache[src, :, :length]


def scale_groups(num_kv_heads: int, scale_granularity: str) -> int:
    """Static scales per layer: 1 (``layer``) or one per kv head (``head``)."""
    return num_kv_heads if scale_granularity == "head" else 1


def _check(kv_cache_dtype: str, scale_granularity: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r} is invalid; allowed: {', '.join(KV_CACHE_DTYPES)}"
        )
    if scale_granularity not in KV_SCALE_GRANULARITIES:
        allowed = ", ".join(KV_SCALE_GRANULARITIES)
        raise ConfigError(f"scale_granularity={scale_granularity!r} is invalid; allowed: {allowed}")
