"""`Engine`: batched generation with exact logprobs over a quantized decoder, in-place weight update.

A facade over small parts: `scheduler` (queue, admission into KV-cache slots, finish checks),
`runner` (prefill and the decode step of `decode`: eager, bucketed or compiled), `sampler` (exact
logprobs from per-request random streams), `scoring` (teacher forcing, KV diagnostics), and from
`flashrl.model` the decoder, the weight map and the fp8 KV-scale state (`KVScaleState`). One
`generate` call is schedule -> run -> postprocess until every request is done.

FP8 KV cache (``kv_cache_dtype="fp8"``, docs/kv_cache.md): ``kv_scale="calibrated"`` recalibrates
static scales after every `update_weights` on the most recent generated sequences, and at the first
generate after loading on its prompts; ``"dynamic"`` scales every token and head at write time; a
float fixes every scale. `add_sample_observer` lets tools watch every sampling step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from flashrl.core.config import RolloutConfig, resolve_config
from flashrl.core.device import peak_memory_bytes
from flashrl.core.env import from_env
from flashrl.core.rollout import Rollout
from flashrl.core.sampling import SamplingParams, replay_processed_logprobs
from flashrl.engine import inputs, scoring
from flashrl.engine.generation import Counters, GenerateProgress, build_requests, to_rollouts
from flashrl.engine.kv_cache import KVCache
from flashrl.engine.options import EngineConfig, EngineOptions, engine_config_of
from flashrl.engine.runner import ModelRunner
from flashrl.engine.sampler import SampledTokens, SamplingTables
from flashrl.engine.scheduler import Request, Scheduler, Step, sample_into
from flashrl.errors import InputError
from flashrl.model.config import ModelConfig
from flashrl.model.decoder import Decoder
from flashrl.model.kv_calibration import KVScales
from flashrl.model.kv_scales import KVScaleState
from flashrl.model.smoothing import SmoothingState
from flashrl.model.weight_changes import ChangeCounts
from flashrl.model.weights import WeightMap
from flashrl.quant.cpu_mirror import enable_mirrors
from flashrl.quant.linear import model_nbytes
from flashrl.utils import synchronize

__all__ = ["Engine", "EngineConfig"]

SampleObserver = Callable[[SampledTokens], None]


class Engine:
    """The built-in rollout engine (implements `flashrl.core.rollout.RolloutBackend`)."""

    def __init__(
        self,
        model_dir: str | Path,
        rollout_config: str | Path | RolloutConfig | None = None,
        engine_config: EngineConfig | None = None,
        **unexpected: Any,
    ) -> None:
        """Load the checkpoint in `model_dir`, its linear layers quantized as `rollout_config` says
        (a scheme name, a YAML path or a `RolloutConfig`; default: FLASHRL_CONFIG, else bf16), run as
        `engine_config` says (`EngineConfig`: device, dtype, KV-cache size, compilation).

        Nothing else: `unexpected` exists only for the `ConfigError` that says which config each
        keyword goes in (``max_batch=8``: `EngineConfig`; ``kv_cache_dtype=``: `RolloutConfig`)."""
        engine = engine_config_of(rollout_config, engine_config, unexpected)
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        config = (
            resolve_config(rollout_config, source="rollout_config")
            if rollout_config is not None
            else from_env()
        )
        opts = EngineOptions.resolve(
            self.model_dir, self.model_config, config or RolloutConfig(), engine
        )
        self.engine_config = engine
        self.config, self.kv_scale_granularity = opts.config, opts.kv_scale_granularity
        self.kv = KVScaleState(
            self.config.kv_cache_dtype, self.config.kv_scale, opts.kv_scale_granularity
        )
        self.kv_calibrated = self.kv.calibrated
        self.device, self.dtype = opts.device, opts.dtype
        self.max_len, self.max_batch = opts.max_len, opts.max_batch
        self.max_prefill_tokens = opts.max_prefill_tokens
        self.progress, self.seed = engine.progress, engine.seed
        self._sr = opts.sync_rounding_generator(self.model_config, self.seed)  # None: nearest
        self.smoothing = SmoothingState(opts.smooth_alpha(self.model_config))
        self._load(engine.load_weights, engine.decode_compile, engine.decode_buckets)

    def _load(
        self, load_weights: bool, decode_compile: str | None, decode_buckets: bool | None
    ) -> None:
        """Build the decoder, its weight map and runner; load the checkpoint and tokenizer."""
        start = time.perf_counter()
        self.model = Decoder(
            self.model_config,
            self.config.quant,
            self.config.skip,
            self.dtype,
            self.device,
            max_len=self.max_len,
            lm_head_fp32=self.config.lm_head_fp32,
        ).eval()
        self.smoothing.enable(self.model)
        # CPU weights: fp32 copies for the GEMMs, within a memory budget (quant/cpu_mirror.py).
        self.mirror_bytes = enable_mirrors(self.model, self.engine_config.cpu_mirror_memory)
        self.weights = WeightMap(self.model, sync_generator=self._sr)
        self.runner = ModelRunner(
            self.model,
            self.max_batch,
            self.max_len,
            self.device,
            decode_compile,
            decode_buckets,
            self.config.kv_cache_dtype,
            self.kv_scale_granularity or "layer",
        )
        self.decode = self.runner.decode
        if load_weights:
            self.weights.load_checkpoint(self.model_dir)
            self.smoothing.pending = self.smoothing.enabled
        self.tokenizer = inputs.load_tokenizer(self.model_dir)
        self.eos_token_ids = inputs.eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        self._observers: list[SampleObserver] = []
        self._stats = Counters(load_s=time.perf_counter() - start)

    # ------------------------------------------------------------------ weights

    def random_weights(
        self, seed: int = 0, std: float = 0.02
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A full set of random weights in Hugging Face naming, as a trainer would send them:
        N(0, std) (norms 1), in the activation dtype on the engine's device. Drawn on that device
        (no host generation and copy of a 7B-dim set on GPU), so a seed gives the same weights on
        every run of one device type, not across device types."""
        return self.weights.random_weights(seed, std, self.dtype, self.device)

    @torch.no_grad()
    def init_random_weights_(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight with `random_weights(seed, std)` through the normal update path; for
        benchmarks at real model dimensions without a checkpoint."""
        for name, tensor in self.random_weights(seed, std):
            self.weights.update_tensor(name, tensor)
        self.kv.weights_changed()

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], count_changed: bool = False
    ) -> dict[str, float]:
        """Update the weights by Hugging Face name, in any order and grouping (q, k and v may come
        in separate calls); quantized layers are re-quantized in place with fresh scales.

        Every tensor is validated before anything is written (`WeightMap.check`: name, shape, a
        float dtype, not meta, no NaN or Inf; two reductions, no copy), so a bad update raises a
        `WeightError` naming the tensor and leaves the engine as it was. Returns seconds
        (``transfer_s`` to the device, ``requantize_s``, ``kv_calibration_s``: 0.0 when there is
        nothing to calibrate, ``weight_update_s`` in all), ``tensors`` and, with `count_changed`, the fraction of the sent elements whose
        stored value changed: ``codes_changed_frac`` (quantized codes), ``dense_changed_frac``
        (values kept in high precision) and ``weights_changed_frac`` (both).

        With ``kv_scale="calibrated"`` every call recalibrates on the most recent generated
        sequences (before any generate, the next generate calibrates on its prompts): send a whole
        update in one call rather than tensor by tensor.
        """
        items = inputs.named_tensor_pairs(named_tensors)
        for name, tensor in items:
            self.weights.check(name, tensor)
        start = time.perf_counter()
        counts = ChangeCounts() if count_changed else None
        self.smoothing.refresh(self.weights, items)  # factors first: then every shard's codes
        transfer, requant, _ = self.weights.update(items, self.device, counts=counts)
        self.kv.weights_changed()
        kv_calibration = self.calibrate_kv() if self.kv.stale and len(self.kv.recent) else 0.0
        result = dict(
            transfer_s=transfer,
            requantize_s=requant,
            kv_calibration_s=kv_calibration,
            weight_update_s=time.perf_counter() - start,
            tensors=float(len(items)),
        )
        self._stats.add(
            transfer_s=transfer,
            requantize_s=requant,
            weight_updates=1,
            weight_update_s=result["weight_update_s"],
        )
        if counts is not None:
            result.update(counts.fractions())
        return result

    # ------------------------------------------------------------------ fp8 KV scales

    @property
    def cache(self) -> KVCache | None:
        """The KV cache (None until the first generate or scoring call allocates it)."""
        return self.runner.cache

    def _ensure_cache(self) -> KVCache:
        return self.runner.ensure_cache(self.kv.initial() if self.runner.cache is None else None)

    @torch.no_grad()
    def calibrate_kv(self, sequences: Sequence[Sequence[int]] | None = None) -> float:
        """Recalibrate the static fp8 KV scales (``kv_scale="calibrated"``) from a forward over
        `sequences` (token ids; default: the most recent generated sequences). Scales are written
        into the cache in place. Returns the seconds it took (also in `stats`)."""
        start = time.perf_counter()
        scales = self.kv.calibrate(self.model, sequences, self.max_len)
        if self.cache is not None:
            self.cache.set_scales(scales.k, scales.v)
        synchronize(self.device)
        return self.kv.record(scales, time.perf_counter() - start)

    def _before_forward(self, prompts: list[list[int]]) -> None:
        """Before a forward: the first smoothing calibration (on `prompts`), then stale fp8 KV scales
        (on the most recent sequences, or on `prompts` when none were generated yet)."""
        self.smoothing.calibrate_if_pending(self.model, self.weights, prompts, self.model_dir, self.device)  # fmt: skip
        if self.kv.stale:
            self.calibrate_kv(self.kv.recent.sequences() or prompts)

    @property
    def kv_scales(self) -> KVScales | None:
        """The last calibrated fp8 KV scales (``kv_scale="calibrated"``), else None."""
        return self.kv.scales

    # ------------------------------------------------------------------ generation

    def add_sample_observer(self, fn: SampleObserver) -> Callable[[], None]:
        """Call ``fn(SampledTokens)`` after every sampling step of `generate` (prefill and decode):
        row k of the record is one request (its prompt and sample index, the token's position in
        the response, the fp32 logits sampled from, the token, its processed logprob). For tools
        and tests; `fn` must not modify what it gets. Returns a function that removes `fn`."""
        self._observers.append(fn)
        return lambda: self._observers.remove(fn) if fn in self._observers else None

    @torch.no_grad()
    def generate(
        self, prompts: inputs.Prompts, params: SamplingParams | None = None
    ) -> list[Rollout]:
        """Sample `params.n` responses per prompt: len(prompts) * n rollouts, prompt-major."""
        start = time.perf_counter()
        vocab = self.model_config.vocab_size
        params = inputs.check_params(params, vocab, self.model_dir)
        encoded = inputs.encode_prompts(
            prompts, self.tokenizer, vocab, self.max_len, self.model_dir
        )
        cache = self._ensure_cache()
        self._before_forward(encoded)
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        tables = SamplingTables.build(
            [len(ids) for ids in encoded], params, base_seed, self.max_len, self.device
        )
        scheduler = Scheduler(self.max_batch, self.max_prefill_tokens)
        for group in build_requests(encoded, params, tables, self.max_len):
            scheduler.add(group)
        stop_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.eos_token_ids)
        )
        progress = GenerateProgress(
            len(encoded) * params.n, self.progress, lambda: self._stats.values["generated_tokens"]
        )
        while scheduler.has_work:
            self._run(scheduler.schedule(), cache, params)
            progress.update(scheduler.postprocess(stop_ids, cache.move_slot))
        progress.close()
        done = scheduler.done
        if self.kv.calibrated:  # the calibration set: sample 0 of every prompt first
            ordered = sorted(done, key=lambda r: (r.sample_index, r.prompt_index))
            self.kv.remember([r.prompt_ids + r.response for r in ordered])
        self._stats.add(
            generate_calls=1,
            prompts=len(encoded),
            sequences=len(done),
            generate_s=time.perf_counter() - start,
        )
        return to_rollouts(done, tables, params, self.tokenizer)

    def _run(self, step: Step, cache: KVCache, params: SamplingParams) -> None:
        """Run one scheduled step: the forward, then sampling (`_record`), timed."""
        start = time.perf_counter()
        if step.is_prefill:
            prompts = [g[0].prompt_ids for g in step.groups]
            logits = self.runner.prefill_groups(
                cache, prompts, [len(g) for g in step.groups], step.first_slot
            )
            self._record(step.requests, logits, params)
            self._stats.add(
                prompt_tokens=sum(map(len, prompts)),
                prefill_forwards=1,
                prefill_s=time.perf_counter() - start,
            )
        else:
            active = step.requests
            logits = self.decode(
                cache, [r.response[-1] for r in active], [r.cache_len for r in active]
            )
            self._record(active, logits, params)
            self._stats.add(decode_steps=1, decode_s=time.perf_counter() - start)

    def _record(
        self, requests: list[Request], logits: torch.Tensor, params: SamplingParams
    ) -> None:
        """Sample and append one token per request, then show the step to the sample observers."""
        record = sample_into(requests, logits, params, record=bool(self._observers))
        self._stats.add(generated_tokens=len(requests))
        for fn in list(self._observers):
            fn(record)

    # ------------------------------------------------------------------ scoring

    def _pairs(self, prompts: Sequence[object], responses: Sequence[object]) -> scoring.Pairs:
        return inputs.check_pairs(prompts, responses, self.model_config.vocab_size, self.max_len)

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of a full causal forward over one sequence (no cache, so an fp8 KV
        cache plays no part; `cached_logits` includes it)."""
        ids = inputs.check_sequence(token_ids, self.model_config.vocab_size, self.max_len)
        return self.model(torch.tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1))[0]

    @torch.no_grad()
    def score(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> list[float]:
        """fp32 logprobs of `response_ids` after `prompt_ids` under the engine's processed
        distribution (same temperature / top-k / top-p rule as sampling; with an fp8 KV cache,
        through the cache)."""
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # validates
        [(prompt, response)] = self._pairs([prompt_ids], [response_ids])
        if self.config.kv_cache_dtype == "fp8":
            logits = self.cached_logits([prompt], [response])[0]
        else:
            logits = self.logits(prompt + response)[len(prompt) - 1 : -1]
        targets = torch.tensor(response, device=self.device)
        return replay_processed_logprobs(logits, targets, temperature, top_k, top_p).tolist()

    @torch.no_grad()
    def cached_logits(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """fp32 logits [len(response), vocab] predicting each token of each response, computed as
        `generate` computes them: a prefill of the prompt, then one decode step per response token
        reading this engine's KV cache (so fp8 KV rounding is included); eager at exact shapes
        whatever `decode_compile` and `decode_buckets` say (`flashrl.engine.scoring`)."""
        pairs = self._pairs(prompts, responses)
        self._before_forward([p for p, _ in pairs])
        return scoring.cached_logits(self.runner, self._ensure_cache(), pairs, self.max_batch)

    @torch.no_grad()
    def kv_cache_mismatch(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """How far this engine's KV cache (e.g. fp8) moves the sampling distribution against an
        unquantized cache on the same weights, teacher-forced on the given sequences
        (`flashrl.engine.scoring.kv_cache_mismatch`: ``kl``, ``k3_kl``, maxima, ``tokens``)."""
        if not temperature > 0:
            raise InputError(f"temperature={temperature!r} must be > 0")
        pairs = self._pairs(prompts, responses)
        self._before_forward([p for p, _ in pairs])
        return scoring.kv_cache_mismatch(
            self.runner, self._ensure_cache(), pairs, self.max_batch, temperature
        )

    # ------------------------------------------------------------------ introspection

    def weight_nbytes(self) -> int:
        return model_nbytes(self.model)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs (all layers, K and V, per-token scales included)."""
        return self.runner.kv_bytes_per_token()

    def stats(self) -> dict[str, float]:
        """`flashrl.core.rollout.BACKEND_STATS`, plus ``load_s``, prefill / decode counters and
        seconds, memory, ``decode_shapes``, `KVScaleState.stats` and `KVCache.stats` (docs/engine.md)."""
        s = dict(self._stats.values)
        s.update(self.kv.stats())
        s["tokens_per_s"] = s["generated_tokens"] / s["generate_s"] if s["generate_s"] else 0.0
        s["decode_tokens_per_s"] = s["generated_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
        s["decode_shapes"] = float(len(self.decode.shapes))
        s["weight_bytes"] = float(self.weight_nbytes())
        s["kv_bytes_per_token"] = float(self.kv_bytes_per_token())
        s["kv_capacity_tokens"] = float(self.max_batch * self.max_len)
        s.update(self.cache.stats() if self.cache is not None else {"kv_cache_bytes": 0.0})
        if "kv_k_scale_mean" not in s and self.kv.scales is not None:
            s.update(self.kv.scales.summary())
        s["peak_memory_bytes"] = float(peak_memory_bytes(self.device))
        return s
