"""What a rollout engine returns, and the protocol every rollout backend implements.

The trainer only sees `RolloutBackend`: the built-in engine (`flashrl.engine.Engine`) and the vLLM
backend (`flashrl.vllm_backend.VLLMBackend`) both implement it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from flashrl.engine.sampler import SamplingParams

FINISH_REASONS = ("stop", "length")
"""`stop`: EOS or a stop token was sampled (and is included in `response_ids`); `length`: max_tokens."""


@dataclass
class Rollout:
    """One sampled response. `logprobs[i]` is the fp32 logprob of `response_ids[i]` under the
    processed distribution it was sampled from (temperature, top-k, top-p applied)."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    raw_logprobs: list[float] | None = None
    prompt_index: int = 0
    """Index of the prompt in the `generate` call; the `n` samples of a prompt are adjacent."""
    sample_index: int = 0
    extra: dict = field(default_factory=dict)


@runtime_checkable
class RolloutBackend(Protocol):
    """Generate with exact logprobs, accept new weights every step, report statistics."""

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """Sample `params.n` responses per prompt; returns len(prompts) * n rollouts, prompt-major."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load new weights by Hugging Face name (re-quantizing in place); returns timings in seconds."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and timings since construction (tokens generated, seconds per phase, memory)."""
        ...
