"""Sampling with exact logprobs: the logprob of each sampled token under the distribution sampled from.

Processing order (the same as vLLM's V1 sampler, so "processed" logprobs agree across engines):
fp32 logits -> temperature -> top-k -> top-p -> softmax -> sample. Top-k keeps the k largest logits
(ties at the k-th value are kept). Top-p sorts ascending and removes the tokens whose cumulative
probability is <= 1 - p, always keeping the most likely token. The returned logprob is
``log_softmax(processed logits)[token]`` in fp32: renormalised over the kept support. Greedy
(temperature 0) returns the log-softmax of the raw logits (no temperature), as vLLM does.

`replay_processed_logprobs` recomputes the same quantity for given tokens from full-sequence logits;
the trainer uses it to replay the rollout's temperature and truncation (mask replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Validated on construction; errors name the field and the allowed range."""

    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens with cumulative probability >= top_p; 1 disables."""
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    """Samples per prompt; they share the prompt's prefill."""
    logprobs: bool = True
    """Return the processed logprob of every sampled token."""
    raw_logprobs: bool = False
    """Also return the raw logprob (log-softmax of the unprocessed logits)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.temperature >= 0, "temperature", self.temperature, ">= 0"),
            (self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 or -1 disables)"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1"),
            (self.n >= 1, "n", self.n, ">= 1"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid; allowed: {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p remove tokens (the trainer must then replay the truncation)."""
        return self.top_k > 0 or self.top_p < 1
