"""`Engine`: batched generation with exact logprobs over a quantized decoder, and in-place weight sync.

Scheduling (continuous batching over KV-cache slots): requests wait in a queue; a prompt's `n`
samples are admitted together when enough slots are free, the prompt is prefilled once and its
K/V copied to the other samples' slots. Every decode step advances all active sequences; a finished
sequence frees its slot, the last active sequence moves into it (so the active set is always slots
0..B-1) and waiting prompts are admitted. One long response therefore does not idle the batch.

Prefill token budget: one prefill forward holds at most `max_prefill_tokens` padded prompt
tokens (groups x longest prompt; default `DEFAULT_MAX_PREFILL_TOKENS`), like vLLM's
``max_num_batched_tokens``: the admitted prompts are split over several forwards, so activation
memory (e.g. an int8 GEMM's int32 accumulator of [tokens, 2 x intermediate]) stays bounded at large
batches of long prompts. A single prompt longer than the budget is prefilled alone.

Randomness: each request (prompt i, sample j) draws from its own stream, seeded from
(seed, i, j), one uniform number per token (inverse-CDF sampling). Seeded runs repeat exactly, and a
request's tokens do not depend on which other requests share its batch, except where the numerics
themselves depend on the batch: per-tensor `fp8` activation scales span the batch, and kernels may
round differently at other batch sizes. Logprobs are exact for whatever was computed either way.

FP8 KV cache (``kv_cache_dtype="fp8"``, docs/kv_cache.md): K and V are stored as e4m3 codes with
fp32 scales (`flashrl.engine.kv_cache`). ``kv_scale="calibrated"`` recalibrates static scales
(`flashrl.engine.kv_calibration`) after every `update_weights` on the most recent generated
sequences, and at the first generate after loading on that call's prompts; ``"dynamic"`` scales
every token and head at write time; a float fixes every scale.

Decode step (`flashrl.engine.decode`, docs/engine.md): the model part of a step runs eagerly at the
exact batch and length by default; ``decode_buckets=True`` pads it to a few shapes, and
``decode_compile=MODE`` compiles it with `torch.compile` (``reduce-overhead``: CUDA graphs, one per
bucket). Sampling and the finish checks stay on the host side: one device-to-host copy of the
sampled tokens per step; uniforms and logprobs live in per-call device tables.
"""

from __future__ import annotations

import json
import logging
import numbers
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from flashrl.config import RolloutConfig, from_env, resolve_config
from flashrl.engine.decode import DecodeStep
from flashrl.engine.kv_cache import KVCache
from flashrl.engine.kv_calibration import KVScales, RecentSequences, calibrate_model
from flashrl.engine.model import Decoder, ForwardBatch, attention_mask
from flashrl.engine.model_config import TOKEN_IDS_ALLOWED, ModelConfig, read_json, token_ids
from flashrl.engine.sampler import SamplingParams, replay_processed_logprobs, sample
from flashrl.engine.weights import WeightMap
from flashrl.errors import CheckpointError, ConfigError, InputError, UnsupportedError, WeightError
from flashrl.quant.linear import QuantLinear
from flashrl.rollout import Rollout
from flashrl.utils import synchronize

logger = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 16384
"""Padded prompt tokens per prefill forward unless `Engine(max_prefill_tokens=...)` says otherwise."""

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is invalid; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def stream_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one request's random stream (splitmix64-style mixing of the three ints)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (x ^ (x >> 32)) & (2**63 - 1)


@dataclass
class _Tables:
    """Per-token device tables of one `generate` call, [requests, max_tokens]: each step reads its
    uniforms and writes its logprobs with one indexing op for the whole batch."""

    uniforms: torch.Tensor | None
    """float64 uniforms of every request's random stream (None when greedy)."""
    logprobs: torch.Tensor
    """fp32 processed logprobs of the sampled tokens."""
    raw_logprobs: torch.Tensor | None
    """fp32 raw logprobs (with ``SamplingParams.raw_logprobs``)."""


@dataclass
class _Request:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    index: int
    """This request's row in `tables`."""
    tables: _Tables
    max_new: int
    response: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def cache_len(self) -> int:
        """Tokens already in the KV cache: the prompt and all but the last sampled token."""
        return len(self.prompt_ids) + len(self.response) - 1

    @property
    def logprobs(self) -> torch.Tensor:
        """Processed logprobs of the tokens sampled so far (a view of the call's table)."""
        return self.tables.logprobs[self.index, : len(self.response)]


class Engine:
    """The built-in rollout engine (implements `flashrl.rollout.RolloutBackend`)."""

    def __init__(
        self,
        model_dir: str | Path,
        quant: str | RolloutConfig | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        lm_head_fp32: bool | None = None,
        max_batch: int | None = None,
        max_len: int | None = None,
        skip: Sequence[str] | None = None,
        seed: int | None = None,
        progress: bool = True,
        load_weights: bool = True,
        kv_cache_dtype: str | None = None,
        kv_scale: str | float | None = None,
        kv_scale_granularity: str | None = None,
        kv_cache_memory: int | None = None,
        decode_compile: str | None = None,
        decode_buckets: bool | None = None,
        max_prefill_tokens: int | None = None,
    ) -> None:
        """Load the checkpoint in `model_dir` with weights quantized by `quant` (a scheme name, a YAML
        path or a `RolloutConfig`; default: FLASHRL_CONFIG, else bf16). `max_batch` sequences (default
        64) of at most `max_len` tokens (prompt + response) fit in the KV cache; alternatively
        `kv_cache_memory` (bytes) sizes the cache and `max_batch` follows from it.
        `load_weights=False` leaves the weights uninitialised (see `init_random_weights_`).

        `kv_cache_dtype` (``bf16`` | ``fp8``) and `kv_scale` (``calibrated`` | ``dynamic`` | a positive
        float) override the config's fields; `kv_scale_granularity` (``layer``, default, or ``head``)
        picks one static scale per layer or per kv head (``dynamic`` scales are per token and head).

        `decode_compile` (None: eager; ``default``, ``reduce-overhead``, ``max-autotune``,
        ``max-autotune-no-cudagraphs``) compiles the decode step's forward with `torch.compile`;
        ``reduce-overhead`` captures a CUDA graph per shape bucket (CUDA only). `decode_buckets` pads
        each decode step to a small set of shapes (default: on exactly when compiled). See
        `flashrl.engine.decode` and docs/engine.md.

        `max_prefill_tokens` caps the padded prompt tokens of one prefill forward (default
        `DEFAULT_MAX_PREFILL_TOKENS`); admitted prompts beyond it are prefilled in further forwards.
        """
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        config = resolve_config(quant, source="quant") if quant is not None else (from_env() or RolloutConfig())
        overrides = {}
        if lm_head_fp32 is not None:
            overrides["lm_head_fp32"] = lm_head_fp32
        if skip is not None:
            overrides["skip"] = tuple(skip)
        if kv_cache_dtype is not None:
            overrides["kv_cache_dtype"] = kv_cache_dtype
        if kv_scale is not None:
            overrides["kv_scale"] = kv_scale
        self.config = RolloutConfig.from_dict({**config.to_dict(), **overrides}) if overrides else config
        self.kv_scale_granularity = _kv_granularity(self.config, kv_scale, kv_scale_granularity)
        self.kv_calibrated = self.config.kv_cache_dtype == "fp8" and self.config.kv_scale == "calibrated"
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.max_len = self._check_max_len(max_len)
        if kv_cache_memory is not None:
            if max_batch is not None:
                raise ConfigError("give max_batch or kv_cache_memory, not both")
            max_batch = self._max_batch_for(kv_cache_memory)
        max_batch = 64 if max_batch is None else max_batch
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch={max_batch!r} is invalid; allowed: an integer >= 1")
        self.max_batch = max_batch
        if max_prefill_tokens is None:
            max_prefill_tokens = DEFAULT_MAX_PREFILL_TOKENS
        if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens={max_prefill_tokens!r} must be a positive int (padded prompt tokens "
                             "per prefill forward)")
        self.max_prefill_tokens = max_prefill_tokens
        self.progress = progress
        self.seed = seed
        start = time.perf_counter()
        self.model = Decoder(self.model_config, self.config.quant, self.config.skip, self.dtype, self.device,
                             max_len=self.max_len, lm_head_fp32=self.config.lm_head_fp32).eval()
        self.weights = WeightMap(self.model)
        self.decode = DecodeStep(self.model, self.max_batch, self.max_len, self.device, compile=decode_compile,
                                 buckets=decode_compile is not None if decode_buckets is None else decode_buckets)
        if load_weights:
            self.weights.load_checkpoint(self.model_dir)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, self.model_config, self.tokenizer)
        self.cache: KVCache | None = None
        self._kv_recent = RecentSequences()
        self._kv_scales: KVScales | None = None
        self._kv_stale = self.kv_calibrated  # calibrated at the first generate, on its prompts
        self._stats = dict(load_s=time.perf_counter() - start, generate_calls=0, prompts=0, sequences=0,
                           prompt_tokens=0, generated_tokens=0, prefill_forwards=0, prefill_s=0.0, decode_s=0.0, decode_steps=0,
                           weight_updates=0, transfer_s=0.0, requant_s=0.0,
                           kv_calibrations=0, kv_calibration_s=0.0, kv_calibration_last_s=0.0, kv_calibration_tokens=0)

    def _check_max_len(self, max_len: int | None) -> int:
        """`max_len` (default: min(max_position_embeddings, 4096)), an integer within the model's
        positions: RoPE tables and the model were made for max_position_embeddings positions."""
        limit = self.model_config.max_position_embeddings
        if max_len is None:
            return min(limit, 4096)
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ConfigError(f"max_len={max_len!r} is invalid; allowed: an integer in [2, {limit}] "
                              f"(max_position_embeddings of {self.model_dir / 'config.json'})")
        if max_len > limit:
            raise ConfigError(f"max_len={max_len} is more than the model's max_position_embeddings={limit} "
                              f"({self.model_dir / 'config.json'}); use max_len <= {limit}")
        return max_len

    def _max_batch_for(self, kv_cache_memory: int) -> int:
        """Slots of `max_len` tokens that fit in `kv_cache_memory` bytes of KV cache."""
        if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)) or not kv_cache_memory >= 1:
            raise ConfigError(f"kv_cache_memory={kv_cache_memory!r} must be a positive number of bytes")
        kv_cache_memory = int(kv_cache_memory)
        c = self.model_config
        args = (c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.config.kv_cache_dtype, self.kv_scale_granularity or "layer")
        tokens = KVCache.capacity_tokens(kv_cache_memory, *args)
        if tokens < self.max_len:
            need = KVCache.fixed_bytes(c.num_layers, c.num_kv_heads, *args[4:]) + self.max_len * KVCache.bytes_per_token(*args)
            raise ConfigError(f"kv_cache_memory={kv_cache_memory} bytes holds {tokens} tokens, less than one sequence of "
                             f"max_len={self.max_len} ({need} bytes); raise kv_cache_memory or lower max_len")
        return tokens // self.max_len

    # ------------------------------------------------------------------ construction helpers

    def random_weights(self, seed: int = 0, std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
        """A full set of random weights in Hugging Face naming, as a trainer would push them: N(0, std)
        (norms 1), in the activation dtype on the engine's device. Drawn on that device (no host
        generation and copy of a 7B-dim set on GPU), so a seed gives the same weights on every run of
        one device type, not across device types."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for name in sorted(self.weights.expected):
            shape = self.weights._expected_shape(self.weights.resolve(name)[0])
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=self.dtype, device=self.device)
            else:
                tensor = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
                yield name, tensor.mul_(std).to(self.dtype)

    @torch.no_grad()
    def init_random_weights_(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight with `random_weights(seed, std)` through the normal update path; for
        benchmarks at real model dimensions without a checkpoint."""
        for name, tensor in self.random_weights(seed, std):
            self.weights.apply(name, tensor)
        self._kv_stale = self.kv_calibrated

    # ------------------------------------------------------------------ generation

    def _encode_prompts(self, prompts: str | Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence | torch.Tensor | np.ndarray):
            raise InputError(f"prompts must be a string, a list of strings or a list of token-id lists, "
                             f"got {type(prompts).__name__}")
        if not len(prompts):
            raise InputError("generate needs at least one prompt; got an empty list")
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InputError(f"{self.model_dir} has no tokenizer; pass token ids instead of text")
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            else:
                ids = self._token_ids(prompt, f"prompt {i}")
            if not ids:
                raise InputError(f"prompt {i} is empty")
            if len(ids) >= self.max_len:
                raise InputError(
                    f"prompt {i} has {len(ids)} tokens; max_len={self.max_len} leaves no room for a response "
                    f"(prompts may have at most {self.max_len - 1} tokens; raise max_len)"
                )
            encoded.append(ids)
        return encoded

    def _token_ids(self, ids: object, what: str) -> list[int]:
        """`ids` (a list, tuple, integer tensor or array of token ids) as a list of ints in the
        vocabulary; anything else is an `InputError` (a float id is refused, never truncated)."""
        vocab = self.model_config.vocab_size
        if isinstance(ids, torch.Tensor):
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() != 1:
                raise InputError(f"{what} is a tensor of dtype {ids.dtype} and shape {tuple(ids.shape)}; allowed: an "
                                 "integer dtype, 1-D")
            ids = ids.tolist()
        elif isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise InputError(f"{what} is {type(ids).__name__}; allowed: a string or a list of token ids")
        for pos, token in enumerate(ids):
            if not _is_token(token) or not 0 <= token < vocab:
                reason = "is outside the vocabulary" if _is_token(token) else "is not an integer"
                raise InputError(f"{what}: token id {token!r} at position {pos} {reason}; allowed: integers in "
                                 f"[0, {vocab})")
        return [int(t) for t in ids]

    def _ensure_cache(self) -> KVCache:
        if self.cache is None:
            c = self.model_config
            self.cache = KVCache(c.num_layers, self.max_batch, c.num_kv_heads, self.max_len, c.head_dim, self.dtype, self.device,
                                 kv_cache_dtype=self.config.kv_cache_dtype, scale_granularity=self.kv_scale_granularity or "layer")
            if isinstance(self.config.kv_scale, float) and self.cache.k_scale is not None:
                self.cache.set_scales(torch.tensor(self.config.kv_scale), torch.tensor(self.config.kv_scale))
            elif self._kv_scales is not None:
                self.cache.set_scales(self._kv_scales.k, self._kv_scales.v)
        return self.cache

    # ------------------------------------------------------------------ fp8 KV scales

    @torch.no_grad()
    def calibrate_kv(self, sequences: Sequence[Sequence[int]] | None = None) -> float:
        """Recalibrate the static fp8 KV scales (``kv_scale="calibrated"``) from a forward over
        `sequences` (token ids; default: the most recent generated sequences). Scales are written
        into the cache in place. Returns the seconds it took (also in `stats`)."""
        if not self.kv_calibrated:
            raise ConfigError(f"calibrate_kv needs kv_cache_dtype='fp8' with kv_scale='calibrated'; this engine has "
                             f"kv_cache_dtype={self.config.kv_cache_dtype!r}, kv_scale={self.config.kv_scale!r}")
        if sequences is None:
            sequences = self._kv_recent.sequences()
        else:
            recent = RecentSequences()  # the same token budget as the automatic calibration set
            recent.add(list(sequences))
            sequences = recent.sequences()
        if not sequences:
            raise InputError("no calibration sequences: pass token ids, or generate first")
        start = time.perf_counter()
        scales = calibrate_model(self.model, sequences, self.kv_scale_granularity, max_len=self.max_len)
        if self.cache is not None:
            self.cache.set_scales(scales.k, scales.v)
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self._kv_scales, self._kv_stale = scales, False
        self._stats["kv_calibrations"] += 1
        self._stats["kv_calibration_s"] += elapsed
        self._stats["kv_calibration_last_s"] = elapsed
        self._stats["kv_calibration_tokens"] = scales.tokens
        return elapsed

    @property
    def kv_scales(self) -> KVScales | None:
        """The last calibrated fp8 KV scales (``kv_scale="calibrated"``), None before the first calibration."""
        return self._kv_scales

    def _remember(self, requests: list[_Request]) -> None:
        """Add finished sequences to the calibration set: sample 0 of every prompt first."""
        ordered = sorted(requests, key=lambda r: (r.sample_index, r.prompt_index))
        self._kv_recent.add([r.prompt_ids + r.response for r in ordered])

    @torch.no_grad()
    def generate(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[Rollout]:
        """Sample `params.n` responses per prompt. Returns len(prompts) * n rollouts, prompt-major."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InputError(f"generate params must be a SamplingParams, got {type(params).__name__}")
        beyond = [t for t in params.stop_token_ids if t >= self.model_config.vocab_size]
        if beyond:
            raise InputError(f"SamplingParams.stop_token_ids {beyond} are outside the vocabulary "
                             f"[0, {self.model_config.vocab_size}) of {self.model_dir}")
        encoded = self._encode_prompts(prompts)
        cache = self._ensure_cache()
        if self._kv_stale:
            self.calibrate_kv(self._kv_recent.sequences() or encoded)
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        tables = self._tables(encoded, params, base_seed)
        queue: deque[list[_Request]] = deque()
        for i, ids in enumerate(encoded):
            group = []
            for j in range(params.n):
                group.append(_Request(i, j, ids, i * params.n + j, tables, min(params.max_tokens, self.max_len - len(ids))))
            for start in range(0, len(group), self.max_batch):  # n > max_batch: split the group
                queue.append(group[start : start + self.max_batch])
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        active: list[_Request] = []
        done: list[_Request] = []
        total = len(encoded) * params.n
        bar_delay = 2.0  # seconds before the bar appears (short calls print nothing)
        bar = tqdm(total=total, unit="seq", desc="generate", delay=bar_delay, disable=not self.progress, leave=False)
        generated_before = self._stats["generated_tokens"]
        start_time = shown = time.perf_counter()
        while queue or active:
            admitted = self._admit(queue, self.max_batch - len(active))
            if admitted:
                self._prefill(admitted, active, cache, params)
            else:
                self._decode_step(active, cache, params)
            finished = [k for k, r in enumerate(active) if self._finish(r, stop_ids)]
            for k in reversed(finished):
                done.append(active[k])
                last = len(active) - 1
                if k != last:
                    cache.move_slot(last, k, active[last].cache_len + 1)
                    active[k] = active[last]
                active.pop()
            now = time.perf_counter()
            if finished or now - shown >= 1.0:  # tokens/s at least every second, also while nothing finishes
                rate = (self._stats["generated_tokens"] - generated_before) / max(now - start_time, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
                if finished:
                    bar.update(len(finished))
                elif now - start_time >= bar_delay:
                    bar.refresh()
                shown = now
        bar.close()
        self._stats["generate_calls"] += 1
        self._stats["prompts"] += len(encoded)
        self._stats["sequences"] += total
        if self.kv_calibrated:
            self._remember(done)
        done.sort(key=lambda r: (r.prompt_index, r.sample_index))
        logprobs = tables.logprobs.cpu() if params.logprobs else None
        raw = tables.raw_logprobs.cpu() if tables.raw_logprobs is not None else None
        return [self._to_rollout(r, logprobs, raw) for r in done]

    def _admit(self, queue: deque[list[_Request]], free_slots: int) -> list[list[_Request]]:
        """Pop the waiting groups that the next prefill forward takes: in order, while their samples
        fit in `free_slots` and the padded prompt tokens (groups x longest prompt) stay within
        `max_prefill_tokens` (the first group always goes, however long its prompt)."""
        admitted: list[list[_Request]] = []
        width = 0
        while queue and len(queue[0]) <= free_slots:
            new_width = max(width, len(queue[0][0].prompt_ids))
            if admitted and new_width * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            group = queue.popleft()
            admitted.append(group)
            free_slots -= len(group)
            width = new_width
        return admitted

    def _tables(self, encoded: list[list[int]], params: SamplingParams, base_seed: int) -> _Tables:
        """The device tables of a generate call: request (i, j) is row i * n + j, and its uniforms are
        the draws of its own stream, seeded from (seed, i, j) (the first `max_tokens`, of which the
        table keeps as many as the longest response can use)."""
        rows = len(encoded) * params.n
        width = min(params.max_tokens, self.max_len - min(len(ids) for ids in encoded))
        uniforms = None
        if not params.greedy:
            uniforms = torch.empty(rows, width, dtype=torch.float64)
            for i in range(len(encoded)):
                for j in range(params.n):
                    gen = torch.Generator().manual_seed(stream_seed(base_seed, i, j))
                    uniforms[i * params.n + j] = torch.rand(params.max_tokens, generator=gen, dtype=torch.float64)[:width]
            uniforms = uniforms.to(self.device)
        logprobs = torch.zeros(rows, width, dtype=torch.float32, device=self.device)
        raw = torch.zeros_like(logprobs) if params.raw_logprobs else None
        return _Tables(uniforms, logprobs, raw)

    def _finish(self, request: _Request, stop_ids: set[int]) -> bool:
        if request.finish_reason is not None:
            return True
        if request.response[-1] in stop_ids:
            request.finish_reason = "stop"
        elif len(request.response) >= request.max_new:
            request.finish_reason = "length"
        return request.finish_reason is not None

    def _record(self, requests: list[_Request], logits: torch.Tensor, params: SamplingParams) -> None:
        """Sample one token for each request from its row of `logits` and append it.

        Per step: one host-to-device copy of (table row, token index) pairs, one gather of the
        uniforms, one scatter of the logprobs, and one device-to-host copy of the tokens (the host
        needs them for the finish checks)."""
        tables = requests[0].tables
        where = torch.tensor([[r.index for r in requests], [len(r.response) for r in requests]], device=self.device)
        uniforms = tables.uniforms[where[0], where[1]] if tables.uniforms is not None else None
        out = sample(logits, params, uniforms)
        tables.logprobs[where[0], where[1]] = out.logprobs
        if tables.raw_logprobs is not None:
            tables.raw_logprobs[where[0], where[1]] = out.raw_logprobs
        for r, token in zip(requests, out.tokens.tolist()):
            r.response.append(token)
        self._stats["generated_tokens"] += len(requests)

    def _prefill(self, groups: list[list[_Request]], active: list[_Request], cache: KVCache, params: SamplingParams) -> None:
        start = time.perf_counter()
        lengths = [len(g[0].prompt_ids) for g in groups]
        width = max(lengths)
        ids = torch.zeros(len(groups), width, dtype=torch.long)
        for row, g in enumerate(groups):
            ids[row, : lengths[row]] = torch.tensor(g[0].prompt_ids)
        first_slot = len(active)
        slots, slot = [], first_slot
        for g in groups:
            slots.append(slot)
            slot += len(g)
        positions = torch.arange(width, device=self.device).expand(len(groups), width)
        mask = None
        if self.model_config.sliding_window is not None and width > self.model_config.sliding_window:
            mask = attention_mask(positions, width, self.model_config.sliding_window)
        batch = ForwardBatch(positions=positions, cache=cache, slots=torch.tensor(slots, device=self.device), mask=mask)
        hidden = self.model.hidden_states(ids.to(self.device), batch)
        last = hidden[torch.arange(len(groups), device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits = self.model.logits(last)
        for g, s, n_tokens in zip(groups, slots, lengths):
            if len(g) > 1:
                cache.copy_slot(s, list(range(s + 1, s + len(g))), n_tokens)
        requests = [r for g in groups for r in g]
        rows = torch.tensor([row for row, g in enumerate(groups) for _ in g], device=self.device)
        self._record(requests, logits[rows], params)
        active.extend(requests)
        self._stats["prompt_tokens"] += sum(lengths)
        self._stats["prefill_forwards"] += 1
        self._stats["prefill_s"] += time.perf_counter() - start

    def _decode_step(self, active: list[_Request], cache: KVCache, params: SamplingParams) -> None:
        """One token for every active sequence (slot b holds active[b]); `self.decode` runs the model
        part (bucketed and compiled when asked), then `_record` samples and appends the tokens."""
        start = time.perf_counter()
        logits = self.decode(cache, [r.response[-1] for r in active], [r.cache_len for r in active])
        self._record(active, logits, params)
        self._stats["decode_steps"] += 1
        self._stats["decode_s"] += time.perf_counter() - start

    def _to_rollout(self, r: _Request, logprobs: torch.Tensor | None, raw: torch.Tensor | None) -> Rollout:
        """`logprobs`, `raw`: the call's tables on the host (None when not returned)."""
        n = len(r.response)
        logprobs = logprobs[r.index, :n].tolist() if logprobs is not None else []
        raw = raw[r.index, :n].tolist() if raw is not None else None
        text = self.tokenizer.decode(r.response, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Rollout(prompt_ids=list(r.prompt_ids), response_ids=list(r.response), text=text, logprobs=logprobs,
                       finish_reason=r.finish_reason or "length", raw_logprobs=raw,
                       prompt_index=r.prompt_index, sample_index=r.sample_index)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of a full causal forward over one sequence (no cache, so an fp8 KV
        cache plays no part; `cached_logits` includes it)."""
        ids = torch.tensor(self._token_ids(token_ids, "sequence"), dtype=torch.long, device=self.device).reshape(1, -1)
        if not 1 <= ids.shape[1] <= self.max_len:
            raise InputError(f"sequence has {ids.shape[1]} tokens; allowed: 1 to max_len={self.max_len}")
        return self.model(ids)[0]

    @torch.no_grad()
    def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int],
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    ) -> list[float]:
        """fp32 logprobs of `response_ids` after `prompt_ids` under the engine's processed distribution
        (same temperature / top-k / top-p rule as sampling; with an fp8 KV cache, through the cache)."""
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # validates
        [(prompt_ids, response_ids)] = self._check_pairs([prompt_ids], [response_ids])
        ids = prompt_ids + response_ids
        if self.config.kv_cache_dtype == "fp8":
            logits = self.cached_logits([prompt_ids], [response_ids])[0]
        else:
            logits = self.logits(ids)[len(prompt_ids) - 1 : len(ids) - 1]
        targets = torch.tensor(list(response_ids), device=self.device)
        return replay_processed_logprobs(logits, targets, temperature, top_k, top_p).tolist()

    # ------------------------------------------------------------------ teacher forcing through the cache

    @torch.no_grad()
    def cached_logits(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """fp32 logits [len(response), vocab] predicting each token of each response, computed as
        `generate` computes them: a prefill of the prompt, then one decode step per response token
        reading this engine's KV cache (so fp8 KV rounding is included). The steps run eagerly at
        their exact shapes whatever `decode_compile` and `decode_buckets` say (those change the
        logits only by float rounding; docs/engine.md)."""
        pairs = self._check_pairs(prompts, responses)
        if self._kv_stale:
            self.calibrate_kv(self._kv_recent.sequences() or [p for p, _ in pairs])
        out: list[list[torch.Tensor]] = [[] for _ in pairs]
        for start in range(0, len(pairs), self.max_batch):
            chunk = pairs[start : start + self.max_batch]
            for t, logits, rows in self._teacher_forced(self._ensure_cache(), chunk):
                for row, logit in zip(rows, logits):
                    out[start + row].append(logit)
        return [torch.stack(rows) for rows in out]

    @torch.no_grad()
    def kv_cache_mismatch(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> dict[str, float]:
        """How far this engine's KV cache (e.g. fp8) moves the sampling distribution, against an
        unquantized cache (activation dtype) on the same weights, teacher-forced on the given
        sequences (e.g. the engine's own rollouts). Per response token, at `temperature`:

        - ``kl``, ``kl_max``: exact KL(pi_kv || pi_ref) of the full next-token distributions (the
          rollout-vs-reference direction of `flashrl.correction`'s ``kl``), mean and max;
        - ``k3_kl``: `flashrl.correction.mismatch_metrics`' estimate from the given tokens;
        - ``logprob_abs_diff_max``, ``logit_abs_diff_max``; ``tokens``.
        """
        from flashrl.correction import mismatch_metrics

        if not temperature > 0:
            raise InputError(f"temperature={temperature!r} must be > 0")
        pairs = self._check_pairs(prompts, responses)
        if self._kv_stale:
            self.calibrate_kv(self._kv_recent.sequences() or [p for p, _ in pairs])
        c = self.model_config
        kls: list[torch.Tensor] = []
        lp_kv = torch.zeros(len(pairs), max(len(r) for _, r in pairs))  # logprobs of the given tokens
        lp_ref = torch.zeros_like(lp_kv)
        mask = torch.zeros_like(lp_kv, dtype=torch.bool)
        logit_diff = 0.0
        for start in range(0, len(pairs), self.max_batch):
            chunk = pairs[start : start + self.max_batch]
            width = max(len(p) + len(r) for p, r in chunk)
            ref = KVCache(c.num_layers, len(chunk), c.num_kv_heads, width, c.head_dim, self.dtype, self.device)
            for (t, a, rows), (_, b, _) in zip(self._teacher_forced(self._ensure_cache(), chunk),
                                               self._teacher_forced(ref, chunk)):
                la, lb = torch.log_softmax(a / temperature, -1), torch.log_softmax(b / temperature, -1)
                kls.append((la.exp() * (la - lb)).sum(-1))
                logit_diff = max(logit_diff, float((a - b).abs().max()))
                targets = torch.tensor([chunk[row][1][t] for row in rows], device=self.device)
                idx = torch.tensor([start + row for row in rows])
                lp_kv[idx, t] = la.gather(1, targets[:, None])[:, 0].cpu()
                lp_ref[idx, t] = lb.gather(1, targets[:, None])[:, 0].cpu()
                mask[idx, t] = True
        kl = torch.cat(kls)
        metrics = mismatch_metrics(lp_ref, lp_kv, mask)
        return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "k3_kl": metrics["k3_kl"],
                "logprob_abs_diff_max": float((lp_kv - lp_ref).abs()[mask].max()),
                "logit_abs_diff_max": logit_diff, "tokens": float(mask.sum())}

    def _check_pairs(self, prompts, responses) -> list[tuple[list[int], list[int]]]:
        if len(prompts) != len(responses) or not len(prompts):
            raise InputError(f"need one response per prompt and at least one pair; got {len(prompts)} prompts "
                             f"and {len(responses)} responses")
        encoded = [self._token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        pairs = []
        for i, (p, r) in enumerate(zip(encoded, responses)):
            r = self._token_ids(r, f"response {i}")
            if not p or not r:
                raise InputError(f"{'prompt' if not p else 'response'} {i} is empty")
            if len(p) + len(r) > self.max_len:
                raise InputError(f"sequence {i} has {len(p) + len(r)} tokens; max_len={self.max_len}")
            pairs.append((p, r))
        return pairs

    def _teacher_forced(self, cache: KVCache, pairs: list[tuple[list[int], list[int]]]):
        """Yield (t, logits [rows, vocab], rows) for t = 0, 1, ...: the logits predicting response
        token t of the sequences `rows` (those whose response is longer than t), with the prompts in
        slots 0..len(pairs)-1 of `cache` and response tokens fed one decode step at a time."""
        n, window = len(pairs), self.model_config.sliding_window
        lengths = [len(p) for p, _ in pairs]
        width = max(lengths)
        ids = torch.zeros(n, width, dtype=torch.long)
        for row, (p, _) in enumerate(pairs):
            ids[row, : len(p)] = torch.tensor(p)
        positions = torch.arange(width, device=self.device).expand(n, width)
        mask = attention_mask(positions, width, window) if window is not None and width > window else None
        batch = ForwardBatch(positions=positions, cache=cache, slots=torch.arange(n, device=self.device), mask=mask)
        hidden = self.model.hidden_states(ids.to(self.device), batch)
        last = hidden[torch.arange(n, device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits = self.model.logits(last)
        for t in range(max(len(r) for _, r in pairs)):
            rows = [row for row, (_, r) in enumerate(pairs) if len(r) > t]
            if t:
                # feed response token t-1 at position len(prompt) + t - 1; finished rows repeat their
                # last position (their outputs are ignored and their slot is their own)
                pos = [min(lengths[row] + t - 1, lengths[row] + len(r) - 1) for row, (_, r) in enumerate(pairs)]
                tok = [r[min(t - 1, len(r) - 1)] for _, r in pairs]
                positions = torch.tensor(pos, device=self.device)[:, None]
                kv_length = max(pos) + 1
                batch = ForwardBatch(positions=positions, cache=cache, decode=True, kv_length=kv_length,
                                     mask=attention_mask(positions, kv_length, window))
                logits = self.model.logits(self.model.hidden_states(torch.tensor(tok, device=self.device)[:, None], batch)[:, 0])
            yield t, logits[rows], rows

    # ------------------------------------------------------------------ weight sync

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], count_changed: bool = False
    ) -> dict[str, float]:
        """Load new weights by Hugging Face name, in any order and grouping (q, k and v may come in
        separate calls); quantized layers are re-quantized in place with fresh scales.

        Every tensor is validated before anything is written (name, shape, a float32 / bfloat16 /
        float16 / float64 dtype, not on the meta device, no NaN or Inf: `WeightMap.check`), so a bad
        update raises a `WeightError` naming the tensor and leaves every engine tensor as it was.
        Validation reads each tensor twice (amax, amin) and copies nothing. Returns timings in
        seconds (``transfer_s`` to the device, ``requant_s``, ``kv_calibration_s``: recalibrating
        fp8 KV scales, 0.0 when there is nothing to calibrate) and, with `count_changed`, the
        fraction of quantized codes that changed.

        With ``kv_scale="calibrated"`` every call recalibrates on the most recent generated sequences
        (before any generate, the next generate calibrates on its prompts): send a whole update in
        one call rather than tensor by tensor.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        for i, item in enumerate(items):
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise WeightError(f"update_weights item {i} must be a (name, tensor) pair, got {type(item).__name__}")
            self.weights.check(*item)
        start = time.perf_counter()
        transfer = requant = 0.0
        changed = 0
        for done, (name, tensor) in enumerate(items):
            t0 = time.perf_counter()
            try:
                on_device = tensor.detach().to(self.device, non_blocking=True)
                synchronize(self.device)
                t1 = time.perf_counter()
                changed += self.weights.apply(name, on_device, count_changed=count_changed, checked=True)
                synchronize(self.device)
            except Exception as err:  # validated, so only the device can fail here (e.g. out of memory)
                err.add_note(f"update_weights failed at tensor {name!r} after writing {done} of {len(items)} "
                             "tensors: the engine holds a partial update; send the whole update again")
                raise
            transfer += t1 - t0
            requant += time.perf_counter() - t1
        self._stats["weight_updates"] += 1
        self._stats["transfer_s"] += transfer
        self._stats["requant_s"] += requant
        kv_calibration = 0.0
        if self.kv_calibrated:
            self._kv_stale = True
            if len(self._kv_recent):
                kv_calibration = self.calibrate_kv()
        result = dict(transfer_s=transfer, requant_s=requant, kv_calibration_s=kv_calibration,
                      total_s=time.perf_counter() - start, tensors=float(len(items)))
        if count_changed:
            codes = sum(m.weight.numel() for m in self.model.modules() if isinstance(m, QuantLinear))
            result["codes_changed_frac"] = changed / codes if codes else 0.0
        return result

    # ------------------------------------------------------------------ introspection

    def weight_nbytes(self) -> int:
        from flashrl.quant.linear import model_nbytes

        return model_nbytes(self.model)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs (all layers, K and V, per-token scales included)."""
        c = self.model_config
        return KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.config.kv_cache_dtype,
                                       self.kv_scale_granularity or "layer")

    def stats(self) -> dict[str, float]:
        """Counters and seconds since construction, memory, ``decode_shapes`` (distinct decode-step
        shapes run: buckets when bucketed), and the fp8 KV state: ``kv_calibrations``,
        ``kv_calibration_s`` (total), ``kv_calibration_last_s``, ``kv_calibration_tokens`` (last),
        ``kv_{k,v}_scale_{mean,max}`` (static scales), ``kv_clipped_values`` / ``kv_clipped_frac``
        (values beyond +-448 * scale at cache writes, clamped), ``kv_bytes_per_token`` and
        ``kv_capacity_tokens`` (max_batch * max_len)."""
        s = dict(self._stats)
        s["decode_tokens_per_s"] = s["generated_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
        s["decode_shapes"] = float(len(self.decode.shapes))
        s["weight_bytes"] = float(self.weight_nbytes())
        s["kv_cache_bytes"] = float(self.cache.nbytes()) if self.cache is not None else 0.0
        s["kv_bytes_per_token"] = float(self.kv_bytes_per_token())
        s["kv_capacity_tokens"] = float(self.max_batch * self.max_len)
        if self.cache is not None and self.cache.k_scale is not None:
            k, v = self.cache.k_scale, self.cache.v_scale
            s.update(kv_k_scale_mean=float(k.mean()), kv_k_scale_max=float(k.max()),
                     kv_v_scale_mean=float(v.mean()), kv_v_scale_max=float(v.max()))
        elif self._kv_scales is not None:
            s.update(self._kv_scales.summary())
        if self.cache is not None and self.cache.quantized:
            clipped, written = int(self.cache.clipped), int(self.cache.written)
            s["kv_clipped_values"] = float(clipped)
            s["kv_clipped_frac"] = clipped / written if written else 0.0
        s["peak_memory_bytes"] = float(peak_memory_bytes(self.device))
        return s


def _kv_granularity(config: RolloutConfig, kv_scale: object, granularity: str | None) -> str | None:
    """The KV scale granularity: None for an unquantized cache, ``token`` for dynamic scales,
    else ``layer`` (default) or ``head``. Options that would have no effect raise."""
    if config.kv_cache_dtype != "fp8":
        given = [name for name, value in (("kv_scale", kv_scale), ("kv_scale_granularity", granularity)) if value is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} apply to kv_cache_dtype='fp8'; this engine has "
                             f"kv_cache_dtype={config.kv_cache_dtype!r}")
        return None
    if config.kv_scale == "dynamic":
        if granularity not in (None, "token"):
            raise ConfigError(f"kv_scale_granularity={granularity!r} does not apply to kv_scale='dynamic' "
                             "(dynamic scales are per token and kv head)")
        return "token"
    if granularity not in (None, "layer", "head"):
        raise ConfigError(f"kv_scale_granularity={granularity!r} is invalid; allowed: layer, head")
    return granularity or "layer"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The engine's device: `device`, or CUDA when available and else the CPU. A device name torch
    does not know is a `ConfigError`; a CUDA device this machine does not have an `UnsupportedError`."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device={device!r} is invalid; allowed: cpu, cuda, cuda:N") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UnsupportedError(f"device={device!r}: CUDA is not available on this machine (torch "
                                   f"{torch.__version__}, built {'without' if torch.version.cuda is None else 'with'} "
                                   "CUDA); available: cpu")
        if resolved.index is not None and resolved.index >= count:
            raise UnsupportedError(f"device={device!r}: CUDA is available with {count} device(s); available: cpu, "
                                   + ", ".join(f"cuda:{i}" for i in range(count)))
    elif resolved.type != "cpu":
        raise UnsupportedError(f"device={device!r}: the engine runs on cpu or cuda")
    return resolved


def _is_token(value: object) -> bool:
    """A token id's type: int or numpy integer, not bool (a float is refused, never truncated)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:  # name the damaged file when a JSON file is the cause
        for name in _TOKENIZER_JSON:
            path = model_dir / name
            if path.is_file():
                try:
                    json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as json_err:
                    raise CheckpointError(f"{path} is not valid JSON ({json_err})") from err
        raise CheckpointError(f"{model_dir}: the tokenizer does not load ({type(err).__name__}: {err})") from err


def _eos_ids(model_dir: Path, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        raw = read_json(generation)
        if not isinstance(raw, dict):
            raise ConfigError(f"{generation} must be a JSON object, got {type(raw).__name__}")
        eos = token_ids(raw.get("eos_token_id"))
        if eos is None:
            raise ConfigError(f"{generation}: eos_token_id={raw.get('eos_token_id')!r} is invalid; "
                              f"allowed: {TOKEN_IDS_ALLOWED}")
        ids |= set(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
