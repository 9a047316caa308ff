"""What a rollout backend returns, the protocol every backend implements, and its one stats schema.

The trainer only sees `RolloutBackend`: the built-in engine (`flashrl.engine.Engine`) and the vLLM
backend (`flashrl.vllm_backend.VLLMBackend`) both implement it, and both fill every key of
`BACKEND_STATS` in `stats()` (each may add keys of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from flashrl.core.sampling import SamplingParams

FINISH_REASONS = ("stop", "length")
"""`stop`: EOS or a stop token was sampled (and is included in `response_ids`); `length`:
max_tokens."""

BACKEND_STATS: dict[str, str] = {
    "generate_calls": "calls of generate",
    "prompts": "prompts given to generate",
    "sequences": "rollouts returned (prompts x n)",
    "prompt_tokens": "prompt tokens prefilled",
    "generated_tokens": "response tokens sampled",
    "generate_s": "seconds spent in generate",
    "tokens_per_s": "generated_tokens / generate_s (0.0 before the first generate)",
    "weight_updates": "calls of update_weights",
    "weight_update_s": "seconds spent in update_weights",
    "transfer_s": "seconds moving new weights into the backend (re-quantization excluded)",
    "requantize_s": "seconds re-quantizing in place",
    "kv_calibration_s": "seconds calibrating fp8 KV scales (0.0 without a calibrated fp8 KV cache)",
}
"""The counters and timings (since construction) that every `RolloutBackend.stats` holds, with
their meaning; all values are floats."""
BACKEND_STATS_KEYS: tuple[str, ...] = tuple(BACKEND_STATS)


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
    routed_experts: torch.Tensor | None = None
    """MoE models with routing capture on (`flashrl.engine.routing.RoutingCapture`): int16
    [len(prompt_ids) + len(response_ids) - 1, MoE layers, top_k], the expert ids each MoE layer
    selected at every position the engine ran through the model (the prompt, then every response
    token but the last), for routing replay in the trainer (`flashrl.rl.routing_replay`)."""


@runtime_checkable
class RolloutBackend(Protocol):
    """Generate with exact logprobs, accept new weights every step, report statistics."""

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Rollout]:
        """Sample `params.n` responses per prompt: len(prompts) * n rollouts, prompt-major."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load new weights by Hugging Face name (re-quantizing in place); returns seconds."""
        ...

    def stats(self) -> dict[str, float]:
        """Every key of `BACKEND_STATS`, plus the backend's own counters (memory, KV scales...)."""
        ...
