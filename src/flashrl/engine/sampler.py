"""Sampling with exact logprobs: one token per row, and its logprob under the distribution used.

The distribution is `flashrl.core.sampling.process_logits` (temperature -> top-k -> top-p); the
returned logprob is ``log_softmax(processed logits)[token]`` in fp32.

Randomness: each request (prompt i, sample j) of a `generate` call draws from its own stream,
seeded from (seed, i, j) by `stream_seed`, one uniform number per token (inverse-CDF sampling).
Seeded runs repeat exactly, and a request's tokens do not depend on which other requests share its
batch, except where the numerics depend on the batch: per-tensor `fp8` activation scales span the
batch, and kernels may round differently at other batch sizes. Logprobs are exact either way.

The uniforms and the sampled logprobs of a call live in per-call device tables (`SamplingTables`),
so a step reads and writes them with one indexing op for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashrl.core.sampling import SamplingParams, process_logits


@dataclass
class SampleOutput:
    tokens: torch.Tensor
    """[B] sampled token ids."""
    logprobs: torch.Tensor
    """[B] fp32 logprob of each token under the processed distribution."""
    raw_logprobs: torch.Tensor | None = None


def sample(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None
) -> SampleOutput:
    """Sample one token per row of `logits` [B, V].

    Sampling is by inverse CDF with one uniform number per row (`uniforms` [B] in [0, 1)), so a
    sequence's draws depend only on its own random stream, not on which other sequences share the
    batch. Greedy rows take the argmax and need no uniforms.
    """
    processed = process_logits(logits, params.temperature, params.top_k, params.top_p)
    logprobs_all = torch.log_softmax(processed, dim=-1)
    if params.greedy:
        tokens = processed.argmax(dim=-1)
    else:
        if uniforms is None:
            raise ValueError("sampling with temperature > 0 needs one uniform number per row")
        cdf = logprobs_all.exp().cumsum(dim=-1)
        target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        # u * total may round up to the total: fall back to the last token with positive probability
        last_positive = (cdf < cdf[:, -1:]).sum(dim=-1)
        tokens = torch.minimum(tokens, last_positive)
    logprobs = logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    raw = None
    if params.raw_logprobs:
        raw_all = torch.log_softmax(logits.float(), dim=-1)
        raw = raw_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return SampleOutput(tokens=tokens, logprobs=logprobs, raw_logprobs=raw)


def stream_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one request's random stream (splitmix64-style mixing of the three ints)."""
    mask = 2**64 - 1
    x = (
        seed * 0x9E3779B97F4A7C15
        + prompt_index * 0xBF58476D1CE4E5B9
        + sample_index * 0x94D049BB133111EB
    ) & mask
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & mask
    return (x ^ (x >> 32)) & (2**63 - 1)


@dataclass
class SamplingTables:
    """Per-token device tables of one `generate` call, [requests, max_tokens]: each step reads its
    uniforms and writes its logprobs with one indexing op for the whole batch. Request (i, j) is
    row ``i * n + j``."""

    uniforms: torch.Tensor | None
    """float64 uniforms of every request's random stream (None when greedy)."""
    logprobs: torch.Tensor
    """fp32 processed logprobs of the sampled tokens."""
    raw_logprobs: torch.Tensor | None
    """fp32 raw logprobs (with ``SamplingParams.raw_logprobs``)."""

    @classmethod
    def build(
        cls,
        prompt_lengths: Sequence[int],
        params: SamplingParams,
        base_seed: int,
        max_len: int,
        device: torch.device,
    ) -> SamplingTables:
        """The tables of a call over prompts of `prompt_lengths`: request (i, j)'s uniforms are the
        draws of its own stream, seeded from (base_seed, i, j) (the first `max_tokens`, of which
        the table keeps as many as the longest response can use)."""
        rows = len(prompt_lengths) * params.n
        width = min(params.max_tokens, max_len - min(prompt_lengths))
        uniforms = None
        if not params.greedy:
            uniforms = torch.empty(rows, width, dtype=torch.float64)
            for i in range(len(prompt_lengths)):
                for j in range(params.n):
                    gen = torch.Generator().manual_seed(stream_seed(base_seed, i, j))
                    draws = torch.rand(params.max_tokens, generator=gen, dtype=torch.float64)
                    uniforms[i * params.n + j] = draws[:width]
            uniforms = uniforms.to(device)
        logprobs = torch.zeros(rows, width, dtype=torch.float32, device=device)
        raw = torch.zeros_like(logprobs) if params.raw_logprobs else None
        return cls(uniforms, logprobs, raw)

    def sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        rows: Sequence[int],
        steps: Sequence[int],
    ) -> SampleOutput:
        """Sample one token per row of `logits` for table rows `rows` at token indices `steps` and
        store the logprobs in the tables.

        Per step: one host-to-device copy of the (row, step) pairs, one gather of the uniforms,
        one scatter of the logprobs, and one device-to-host copy of the tokens (the host needs
        them for the finish checks)."""
        where = torch.tensor([list(rows), list(steps)], device=self.logprobs.device)
        uniforms = self.uniforms[where[0], where[1]] if self.uniforms is not None else None
        out = sample(logits, params, uniforms)
        self.logprobs[where[0], where[1]] = out.logprobs
        if self.raw_logprobs is not None:
            self.raw_logprobs[where[0], where[1]] = out.raw_logprobs
        return out


@dataclass(frozen=True)
class SampledTokens:
    """One sampling step of `Engine.generate` as sample observers see it
    (`Engine.add_sample_observer`); row k describes one request."""

    prompt_index: tuple[int, ...]
    sample_index: tuple[int, ...]
    step: tuple[int, ...]
    """Position of the sampled token in its response (0: the first response token)."""
    logits: torch.Tensor
    """[B, vocab] fp32 logits the tokens were sampled from (before temperature and truncation)."""
    tokens: tuple[int, ...]
    logprobs: torch.Tensor
    """[B] fp32 processed logprobs of the tokens (what the rollouts report)."""
