"""`Engine`: batched generation with exact logprobs over a quantized decoder, and in-place weight sync.

Scheduling (continuous batching over KV-cache slots): requests wait in a queue; a prompt's `n`
samples are admitted together when enough slots are free, the prompt is prefilled once and its
K/V copied to the other samples' slots. Every decode step advances all active sequences; a finished
sequence frees its slot, the last active sequence moves into it (so the active set is always slots
0..B-1) and waiting prompts are admitted. One long response therefore does not idle the batch.

Randomness: each request (prompt i, sample j) draws from its own stream, seeded from
(seed, i, j), one uniform number per token (inverse-CDF sampling). A request's tokens therefore do
not depend on batch size or on which other requests run beside it, and seeded runs repeat exactly.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashrl.config import RolloutConfig, from_env, resolve_config
from flashrl.engine.kv_cache import KVCache
from flashrl.engine.model import Decoder, ForwardBatch, attention_mask
from flashrl.engine.model_config import ModelConfig
from flashrl.engine.sampler import SamplingParams, replay_processed_logprobs, sample
from flashrl.engine.weights import WeightMap, iter_checkpoint
from flashrl.quant.linear import QuantLinear
from flashrl.rollout import Rollout

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is invalid; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def stream_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one request's random stream (splitmix64-style mixing of the three ints)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (x ^ (x >> 32)) & (2**63 - 1)


@dataclass
class _Request:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    uniforms: torch.Tensor | None
    max_new: int
    response: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    raw_logprobs: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def cache_len(self) -> int:
        """Tokens already in the KV cache: the prompt and all but the last sampled token."""
        return len(self.prompt_ids) + len(self.response) - 1


class Engine:
    """The built-in rollout engine (implements `flashrl.rollout.RolloutBackend`)."""

    def __init__(
        self,
        model_dir: str | Path,
        quant: str | RolloutConfig | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        lm_head_fp32: bool | None = None,
        max_batch: int = 64,
        max_len: int | None = None,
        skip: Sequence[str] | None = None,
        seed: int | None = None,
        progress: bool = True,
        load_weights: bool = True,
    ) -> None:
        """Load the checkpoint in `model_dir` with weights quantized by `quant` (a scheme name, a YAML
        path or a `RolloutConfig`; default: FLASHRL_CONFIG, else bf16). `max_batch` sequences of at
        most `max_len` tokens (prompt + response) fit in the KV cache. `load_weights=False` leaves
        the weights uninitialised (see `init_random_weights_`)."""
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        config = resolve_config(quant, source="quant") if quant is not None else (from_env() or RolloutConfig())
        overrides = {}
        if lm_head_fp32 is not None:
            overrides["lm_head_fp32"] = lm_head_fp32
        if skip is not None:
            overrides["skip"] = tuple(skip)
        self.config = RolloutConfig.from_dict({**config.to_dict(), **overrides}) if overrides else config
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(dtype)
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.max_batch = max_batch
        self.max_len = max_len or min(self.model_config.max_position_embeddings, 4096)
        self.progress = progress
        self.seed = seed
        start = time.perf_counter()
        self.model = Decoder(self.model_config, self.config.quant, self.config.skip, self.dtype, self.device,
                             max_len=self.max_len, lm_head_fp32=self.config.lm_head_fp32).eval()
        self.weights = WeightMap(self.model)
        if load_weights:
            self.weights.load(iter_checkpoint(self.model_dir))
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, self.model_config, self.tokenizer)
        self.cache: KVCache | None = None
        self._stats = dict(load_s=time.perf_counter() - start, generate_calls=0, prompts=0, sequences=0,
                           prompt_tokens=0, generated_tokens=0, prefill_s=0.0, decode_s=0.0, decode_steps=0,
                           weight_updates=0, transfer_s=0.0, requant_s=0.0)

    # ------------------------------------------------------------------ construction helpers

    @torch.no_grad()
    def init_random_weights_(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight with N(0, std) (norms with 1) through the normal update path; for
        benchmarks at real model dimensions without a checkpoint."""
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def tensors():
            for name in sorted(self.weights.expected):
                shape = self.weights._expected_shape(self.weights.resolve(name)[0])
                if name.endswith("norm.weight"):
                    yield name, torch.ones(shape)
                else:
                    yield name, torch.randn(shape, generator=gen) * std

        for name, tensor in tensors():
            self.weights.apply(name, tensor.to(self.device, self.dtype if self.dtype != torch.float32 else torch.float32))

    # ------------------------------------------------------------------ generation

    def _encode_prompts(self, prompts: str | Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"{self.model_dir} has no tokenizer; pass token ids instead of text")
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            else:
                ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= self.max_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; max_len={self.max_len} leaves no room for a response "
                    f"(prompts may have at most {self.max_len - 1} tokens; raise max_len)"
                )
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:5]} outside the vocabulary [0, {self.model_config.vocab_size})")
            encoded.append(ids)
        return encoded

    def _ensure_cache(self) -> KVCache:
        if self.cache is None:
            c = self.model_config
            self.cache = KVCache(c.num_layers, self.max_batch, c.num_kv_heads, self.max_len, c.head_dim, self.dtype, self.device)
        return self.cache

    @torch.no_grad()
    def generate(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[Rollout]:
        """Sample `params.n` responses per prompt. Returns len(prompts) * n rollouts, prompt-major."""
        params = params or SamplingParams()
        encoded = self._encode_prompts(prompts)
        cache = self._ensure_cache()
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        queue: deque[list[_Request]] = deque()
        for i, ids in enumerate(encoded):
            group = []
            for j in range(params.n):
                uniforms = None
                if not params.greedy:
                    gen = torch.Generator().manual_seed(stream_seed(base_seed, i, j))
                    uniforms = torch.rand(params.max_tokens, generator=gen, dtype=torch.float64).to(self.device)
                group.append(_Request(i, j, ids, uniforms, min(params.max_tokens, self.max_len - len(ids))))
            for start in range(0, len(group), self.max_batch):  # n > max_batch: split the group
                queue.append(group[start : start + self.max_batch])
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        active: list[_Request] = []
        done: list[_Request] = []
        total = len(encoded) * params.n
        bar = tqdm(total=total, unit="seq", desc="generate", delay=2.0, disable=not self.progress, leave=False)
        generated_before = self._stats["generated_tokens"]
        start_time = time.perf_counter()
        while queue or active:
            admitted: list[list[_Request]] = []
            while queue and len(queue[0]) <= self.max_batch - len(active) - sum(map(len, admitted)):
                admitted.append(queue.popleft())
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
            if finished:
                bar.update(len(finished))
                elapsed = time.perf_counter() - start_time
                bar.set_postfix(tok_s=f"{(self._stats['generated_tokens'] - generated_before) / max(elapsed, 1e-9):.0f}")
        bar.close()
        self._stats["generate_calls"] += 1
        self._stats["prompts"] += len(encoded)
        self._stats["sequences"] += total
        done.sort(key=lambda r: (r.prompt_index, r.sample_index))
        return [self._to_rollout(r, params) for r in done]

    def _finish(self, request: _Request, stop_ids: set[int]) -> bool:
        if request.finish_reason is not None:
            return True
        if request.response[-1] in stop_ids:
            request.finish_reason = "stop"
        elif len(request.response) >= request.max_new:
            request.finish_reason = "length"
        return request.finish_reason is not None

    def _record(self, requests: list[_Request], logits: torch.Tensor, params: SamplingParams) -> None:
        """Sample one token for each request from its row of `logits` and append it."""
        uniforms = None
        if not params.greedy:
            uniforms = torch.stack([r.uniforms[len(r.response)] for r in requests])
        out = sample(logits, params, uniforms)
        tokens = out.tokens.tolist()
        for k, r in enumerate(requests):
            r.response.append(tokens[k])
            r.logprobs.append(out.logprobs[k])
            if out.raw_logprobs is not None:
                r.raw_logprobs.append(out.raw_logprobs[k])
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
        self._stats["prefill_s"] += time.perf_counter() - start

    def _decode_step(self, active: list[_Request], cache: KVCache, params: SamplingParams) -> None:
        start = time.perf_counter()
        positions = torch.tensor([[r.cache_len] for r in active], device=self.device)
        tokens = torch.tensor([[r.response[-1]] for r in active], device=self.device)
        kv_length = int(positions.max()) + 1
        mask = attention_mask(positions, kv_length, self.model_config.sliding_window)
        batch = ForwardBatch(positions=positions, cache=cache, decode=True, kv_length=kv_length, mask=mask)
        hidden = self.model.hidden_states(tokens, batch)
        self._record(active, self.model.logits(hidden[:, 0]), params)
        self._stats["decode_steps"] += 1
        self._stats["decode_s"] += time.perf_counter() - start

    def _to_rollout(self, r: _Request, params: SamplingParams) -> Rollout:
        logprobs = torch.stack(r.logprobs).tolist() if params.logprobs else []
        raw = torch.stack(r.raw_logprobs).tolist() if r.raw_logprobs else None
        text = self.tokenizer.decode(r.response, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Rollout(prompt_ids=list(r.prompt_ids), response_ids=list(r.response), text=text, logprobs=logprobs,
                       finish_reason=r.finish_reason or "length", raw_logprobs=raw,
                       prompt_index=r.prompt_index, sample_index=r.sample_index)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of a full causal forward over one sequence (no cache)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        if ids.shape[1] > self.max_len:
            raise ValueError(f"sequence has {ids.shape[1]} tokens; max_len={self.max_len}")
        return self.model(ids)[0]

    @torch.no_grad()
    def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int],
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    ) -> list[float]:
        """fp32 logprobs of `response_ids` after `prompt_ids` under the engine's processed distribution
        (same temperature / top-k / top-p rule as sampling)."""
        if not prompt_ids or not response_ids:
            raise ValueError("score needs a non-empty prompt and response")
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # validates
        ids = list(prompt_ids) + list(response_ids)
        logits = self.logits(ids)[len(prompt_ids) - 1 : len(ids) - 1]
        targets = torch.tensor(list(response_ids), device=self.device)
        return replay_processed_logprobs(logits, targets, temperature, top_k, top_p).tolist()

    # ------------------------------------------------------------------ weight sync

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], count_changed: bool = False
    ) -> dict[str, float]:
        """Load new weights by Hugging Face name, in any order and grouping (q, k and v may come in
        separate calls); quantized layers are re-quantized in place with fresh scales.

        Every name and shape is checked before anything is written, so a bad update leaves the
        engine unchanged. Returns timings in seconds (transfer to the device, requantization) and,
        with `count_changed`, the fraction of quantized codes that changed.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        for name, tensor in items:
            self.weights.check(name, tensor)
        start = time.perf_counter()
        transfer = requant = 0.0
        changed = 0
        for name, tensor in items:
            t0 = time.perf_counter()
            on_device = tensor.detach().to(self.device, non_blocking=True)
            _sync(self.device)
            t1 = time.perf_counter()
            changed += self.weights.apply(name, on_device, count_changed=count_changed)
            _sync(self.device)
            transfer += t1 - t0
            requant += time.perf_counter() - t1
        self._stats["weight_updates"] += 1
        self._stats["transfer_s"] += transfer
        self._stats["requant_s"] += requant
        result = dict(transfer_s=transfer, requant_s=requant, total_s=time.perf_counter() - start, tensors=float(len(items)))
        if count_changed:
            codes = sum(m.weight.numel() for m in self.model.modules() if isinstance(m, QuantLinear))
            result["codes_changed_frac"] = changed / codes if codes else 0.0
        return result

    # ------------------------------------------------------------------ introspection

    def weight_nbytes(self) -> int:
        from flashrl.quant.linear import model_nbytes

        return model_nbytes(self.model)

    def stats(self) -> dict[str, float]:
        s = dict(self._stats)
        s["decode_tokens_per_s"] = s["generated_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
        s["weight_bytes"] = float(self.weight_nbytes())
        s["kv_cache_bytes"] = float(self.cache.nbytes()) if self.cache is not None else 0.0
        s["peak_memory_bytes"] = float(peak_memory_bytes(self.device))
        return s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _eos_ids(model_dir: Path, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

