"""FP8 KV-cache scales: one calibration rule, shared by the built-in engine and the vLLM backend.

A static KV scale is the dequantization multiplier of one layer (or one kv head):

    k_scale = max(amax_K * margin, 1e-10) / 448          (same for V; flashrl.quant rules)

measured by a calibration forward over recent sequences, after every weight update. K is taken
after q/k norm and RoPE, i.e. exactly what the cache stores (`ForwardBatch.kv_observer`).

Two choices make the rule hold for tokens the calibration did not see:

- **RoPE-invariant K amax.** RoPE rotates each rotate-half pair ``(k_i, k_{i + D/2})`` by an angle
  that depends only on the position, so the same key at another position can put the whole pair
  norm ``sqrt(k_i^2 + k_{i+D/2}^2)`` into one element. The K amax is therefore the largest pair
  norm, not the largest element: an upper bound of the element amax (at most sqrt(2) larger) that
  does not depend on the positions the calibration happened to use. V has no RoPE: element amax.
- **A margin, because e4m3 is a float.** Above the scale, values clip (the large error); below it,
  e4m3 keeps 3 mantissa bits down to 2^-6 of the scale's range, so a scale that is k times too
  large costs nothing until values fall below amax * k / 28672 (subnormals). `KV_MARGIN` = 2 is
  cheap headroom for decode tokens and next-step prompts whose K/V exceed the calibration set's
  (docs/kv_cache.md has the measurements behind the number; NeMo-RL uses 1.05 on the step's own
  data, vLLM's removed `calculate_kv_scales` used 2.24 for K and 4.48 for V).

Calibration data: the engine keeps the most recent sequences it generated (prompt + response, a
`RecentSequences` ring of `CALIBRATION_TOKENS` tokens, one sample of each prompt first). After a
weight update it recalibrates on them; before the first generate there are none, so the first
generate calibrates on its own prompts. `fallback_sequences` (seeded random token ids) is the last
resort where nothing else exists (the vLLM backend before any rollout).

`calibrate_model` runs a whole `Decoder` (built-in engine). `calibrate_from_weights` computes the
same statistics one decoder layer at a time from Hugging Face named tensors (a trainer's
parameters or a checkpoint), holding one layer in memory: the vLLM backend uses it, because
vLLM's forward cannot be hooked under CUDA graphs and its hand-set scales are reset on every reload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flashrl.core.config import KV_SCALE_GRANULARITIES
from flashrl.errors import CheckpointError, ConfigError, InputError
from flashrl.model.batch import ForwardBatch, KVObserver, pad_right
from flashrl.model.config import ModelConfig
from flashrl.model.decoder import Decoder
from flashrl.model.weights import WeightMap, checkpoint_files
from flashrl.quant.primitives import scale_from_amax
from flashrl.quant.schemes import FP8_E4M3_QMAX

KV_MARGIN = 2.0
"""Headroom over the calibrated amax (see the module docstring and docs/kv_cache.md)."""
CALIBRATION_TOKENS = 2048
"""Token budget of the calibration set (a forward over this many tokens per recalibration)."""
CALIBRATION_SEQ_TOKENS = 512
"""Each calibration sequence is cut to its first this many tokens (RoPE invariance covers later
positions; the prompt start, where attention sinks live, is kept)."""
BATCH_TOKENS = 8192
"""Padded tokens per calibration forward."""


@dataclass
class KVScales:
    """Calibrated scales: `k`, `v` [num_layers, groups] fp32 (groups = 1 or kv heads); `q`
    [num_layers] when asked for (vLLM's FP8 attention backends may quantize Q); the amax they come
    from ([num_layers, kv_heads]) and how many tokens were seen."""

    k: torch.Tensor
    v: torch.Tensor
    k_amax: torch.Tensor
    v_amax: torch.Tensor
    tokens: int
    margin: float
    q: torch.Tensor | None = None

    def summary(self) -> dict[str, float]:
        """Mean and max of the K and V scales (engine stats, logs)."""
        return {
            "kv_k_scale_mean": float(self.k.mean()),
            "kv_k_scale_max": float(self.k.max()),
            "kv_v_scale_mean": float(self.v.mean()),
            "kv_v_scale_max": float(self.v.max()),
        }


def rope_pair_amax(x: torch.Tensor) -> torch.Tensor:
    """Per (batch, head, position) max over rotate-half pairs of ``sqrt(x_i^2 + x_{i+D/2}^2)`` for
    x [B, heads, T, D], in fp32: the largest value any RoPE rotation of the row can produce. An odd
    head_dim (no pairs) gives the element amax."""
    x = x.float()
    d = x.shape[-1]
    if d % 2:
        return x.abs().amax(-1)
    return torch.hypot(x[..., : d // 2], x[..., d // 2 :]).amax(-1)


def scales_from_amax(amax: torch.Tensor, margin: float = KV_MARGIN) -> torch.Tensor:
    """``max(amax * margin, 1e-10) / 448`` in fp32 (flashrl.quant's scale floor and division)."""
    if not margin >= 1.0:
        raise ConfigError(
            f"margin={margin!r} must be >= 1 (a margin below 1 clips the calibration set itself)"
        )
    return scale_from_amax(amax.float() * margin, FP8_E4M3_QMAX)


class KVAmaxObserver:
    """A `ForwardBatch.kv_observer` that keeps, per layer and kv head, the amax of K (RoPE pair
    norm) and V over valid positions; optionally the per-layer amax of Q (pair norm)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        device: torch.device | str,
        include_q: bool = False,
    ) -> None:
        self.k_amax = torch.zeros(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.v_amax = torch.zeros_like(self.k_amax)
        self.q_amax = (
            torch.zeros(num_layers, dtype=torch.float32, device=device) if include_q else None
        )
        self.valid: torch.Tensor | None = None
        """[B, T] bool for the current batch (False = padding, excluded); None = all valid."""
        self.tokens = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_rows, v_rows = rope_pair_amax(k), v.float().abs().amax(-1)  # [B, kv_heads, T]
        if self.valid is not None:
            keep = self.valid[:, None, :]
            k_rows, v_rows = torch.where(keep, k_rows, 0.0), torch.where(keep, v_rows, 0.0)
        torch.maximum(self.k_amax[layer], k_rows.amax(dim=(0, 2)), out=self.k_amax[layer])
        torch.maximum(self.v_amax[layer], v_rows.amax(dim=(0, 2)), out=self.v_amax[layer])
        if self.q_amax is not None:
            q_rows = rope_pair_amax(q)
            if self.valid is not None:
                q_rows = torch.where(self.valid[:, None, :], q_rows, 0.0)
            self.q_amax[layer] = torch.maximum(self.q_amax[layer], q_rows.amax())

    def scales(self, granularity: str = "layer", margin: float = KV_MARGIN) -> KVScales:
        """Scales at `granularity` (``layer``: max over heads; ``head``: one per kv head)."""
        if granularity not in KV_SCALE_GRANULARITIES[:2]:
            raise ConfigError(
                f"granularity={granularity!r} is invalid for static scales; allowed: layer, head"
            )
        amax = (self.k_amax, self.v_amax) + ((self.q_amax,) if self.q_amax is not None else ())
        if not all(bool(torch.isfinite(a).all()) for a in amax):
            raise ValueError(
                "KV calibration saw non-finite K, V or Q values: the model weights "
                "produce NaN or Inf"
            )
        k, v = self.k_amax, self.v_amax
        if granularity == "layer":
            k, v = k.amax(1, keepdim=True), v.amax(1, keepdim=True)
        q = scales_from_amax(self.q_amax, margin) if self.q_amax is not None else None
        return KVScales(
            k=scales_from_amax(k, margin),
            v=scales_from_amax(v, margin),
            k_amax=self.k_amax.clone(),
            v_amax=self.v_amax.clone(),
            tokens=self.tokens,
            margin=margin,
            q=q,
        )


class RecentSequences:
    """The calibration set: recent token sequences (prompt + response), newest first, cut to
    `max_seq_tokens` each and `max_tokens` in total."""

    def __init__(
        self, max_tokens: int = CALIBRATION_TOKENS, max_seq_tokens: int = CALIBRATION_SEQ_TOKENS
    ) -> None:
        if max_tokens < 1 or max_seq_tokens < 1:
            raise ConfigError(
                f"max_tokens={max_tokens} and max_seq_tokens={max_seq_tokens} must be >= 1"
            )
        self.max_tokens, self.max_seq_tokens = max_tokens, max_seq_tokens
        self._sequences: list[list[int]] = []

    def add(self, sequences: Sequence[Sequence[int]]) -> None:
        """Put `sequences` (most important first) in front of the set; the oldest fall out."""
        new = [[int(t) for t in s[: self.max_seq_tokens]] for s in sequences if len(s)]
        self._sequences = _fit(new + self._sequences, self.max_tokens)

    def sequences(self) -> list[list[int]]:
        return [list(s) for s in self._sequences]

    def __len__(self) -> int:
        return len(self._sequences)


def _fit(sequences: list[list[int]], budget: int) -> list[list[int]]:
    out, total = [], 0
    for s in sequences:
        if total >= budget:
            break
        out.append(s[: budget - total])
        total += len(out[-1])
    return out


def fallback_sequences(
    vocab_size: int, count: int = 8, length: int = 64, seed: int = 0
) -> list[list[int]]:
    """Seeded random token ids: the calibration set of last resort (no real prompt seen yet)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen).tolist()


def padded_batches(
    sequences: Sequence[Sequence[int]], device: torch.device | str, batch_tokens: int = BATCH_TOKENS
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded batches of similar length: (ids [B, T] long, valid [B, T] bool), at most
    `batch_tokens` padded tokens each (a longer single sequence forms its own batch)."""
    order = sorted((s for s in sequences if len(s)), key=len, reverse=True)
    start = 0
    while start < len(order):
        count = max(1, batch_tokens // len(order[start]))
        padded = pad_right(order[start : start + count], device)
        yield padded.ids, padded.valid
        start += count


def _check_sequences(
    sequences: Sequence[Sequence[int]], vocab_size: int, max_len: int
) -> list[list[int]]:
    seqs = [[int(t) for t in s[:max_len]] for s in sequences if len(s)]
    if not seqs:
        raise InputError("KV calibration needs at least one non-empty token sequence")
    bad = [t for s in seqs for t in s if not 0 <= t < vocab_size][:5]
    if bad:
        raise InputError(f"calibration token id(s) {bad} outside the vocabulary [0, {vocab_size})")
    return seqs


def _forward_batch(ids: torch.Tensor, window: int | None, observer: KVObserver) -> ForwardBatch:
    """A no-cache causal forward over right-padded `ids` [B, T] that reports K/V to `observer`."""
    return ForwardBatch.prefill(
        ids.shape[0], ids.shape[1], ids.device, window, kv_observer=observer
    )


@torch.no_grad()
def calibrate_model(
    model: Decoder,
    sequences: Sequence[Sequence[int]],
    granularity: str = "layer",
    margin: float = KV_MARGIN,
    max_len: int | None = None,
    include_q: bool = False,
) -> KVScales:
    """Scales from a no-cache forward of `model` over `sequences` (cut to `max_len` tokens)."""
    c = model.config
    device = model.embed_tokens.weight.device
    seqs = _check_sequences(sequences, c.vocab_size, max_len or model.rotary.cos.shape[0])
    observer = KVAmaxObserver(c.num_layers, c.num_kv_heads, device, include_q)
    for ids, valid in padded_batches(seqs, device):
        observer.valid = valid
        model.hidden_states(ids, _forward_batch(ids, c.sliding_window, observer))
    observer.tokens = sum(map(len, seqs))
    return observer.scales(granularity, margin)


@torch.no_grad()
def calibrate_from_weights(
    get_tensor: Callable[[str], torch.Tensor],
    config: ModelConfig,
    sequences: Sequence[Sequence[int]],
    scheme: str = "bf16",
    skip: Sequence[str] = (),
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    granularity: str = "layer",
    margin: float = KV_MARGIN,
    include_q: bool = False,
) -> KVScales:
    """The statistics of `calibrate_model`, computed from Hugging Face named tensors one decoder
    layer at a time (peak memory: the embedding plus one layer, quantized with `scheme`).

    `get_tensor(name)` returns a checkpoint tensor by name, e.g.
    ``dict(trainer_params).__getitem__`` or `checkpoint_getter` (which raises a `CheckpointError`
    naming a tensor the checkpoint lacks).
    """
    seqs = _check_sequences(sequences, config.vocab_size, config.max_position_embeddings)
    device = torch.device(device)
    one = dataclasses.replace(config, num_layers=1, tie_word_embeddings=True)
    model = Decoder(one, scheme, tuple(skip), dtype, device, max_len=max(map(len, seqs))).eval()
    weights = WeightMap(model)
    weights.update_tensor(
        "model.embed_tokens.weight", get_tensor("model.embed_tokens.weight").to(device)
    )
    batches = list(padded_batches(seqs, device))
    hidden = [model.embed_tokens(ids) for ids, _ in batches]
    layer_names = sorted(n for n in weights.expected if n.startswith("model.layers.0."))
    observer = KVAmaxObserver(config.num_layers, config.num_kv_heads, device, include_q)
    for layer in range(config.num_layers):
        for name in layer_names:
            weights.update_tensor(
                name,
                get_tensor(f"model.layers.{layer}." + name.removeprefix("model.layers.0.")).to(
                    device
                ),
            )

        def observe(
            _: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = layer
        ) -> None:
            observer(layer, q, k, v)

        for i, (ids, valid) in enumerate(batches):
            observer.valid = valid
            batch = _forward_batch(ids, config.sliding_window, observe)
            hidden[i] = model.layers[0](hidden[i], batch, model.rotary)
    observer.tokens = sum(map(len, seqs))
    return observer.scales(granularity, margin)


def calibration_tensor_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensors `calibrate_from_weights` reads (embedding, every decoder layer)."""
    one = dataclasses.replace(config, num_layers=1, tie_word_embeddings=True)
    per_layer = sorted(
        n.removeprefix("model.layers.0.")
        for n in WeightMap(Decoder(one, device="meta", max_len=1)).expected
        if n.startswith("model.layers.0.")
    )
    return ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer
    ]


def checkpoint_getter(model_dir: str | Path) -> Callable[[str], torch.Tensor]:
    """``get_tensor(name)`` reading single tensors lazily from the safetensors of `model_dir`."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), file))

    def get_tensor(name: str) -> torch.Tensor:
        if name not in where:
            raise CheckpointError(f"checkpoint {model_dir} has no tensor {name!r}")
        with safe_open(str(where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return get_tensor
