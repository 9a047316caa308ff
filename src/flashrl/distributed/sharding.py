"""One step's prompts as shards: fixed by the config, so rollouts do not depend on the workers.

The built-in engine seeds request (i, j) of a `generate` call from ``(seed, i, j)``
(`flashrl.engine.sampler.stream_seed`). A shard of prompts ``[first, last)`` generated in its own
call with seed `shard_seed(seed, first)` draws exactly the streams the whole batch would have:
``stream_seed(shard_seed(s, g), i, j) == stream_seed(s, g + i, j)``. The sampled tokens are
therefore the same however the prompts are split; the logprobs' last bits can depend on what else
is in the batch (padding and GEMM shapes), so a step's prompts are always split into the same
`num_shards` shards, each one `generate` call, whichever worker (or the trainer itself) runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashrl.core.rollout import Rollout
from flashrl.errors import ConfigError

_MASK = 2**64 - 1
_SEED_MUL = 0x9E3779B97F4A7C15
_PROMPT_MUL = 0xBF58476D1CE4E5B9
_PROMPT_STEP = (_PROMPT_MUL * pow(_SEED_MUL, -1, 2**64)) & _MASK
"""``stream_seed`` mixes ``seed * A + i * B`` modulo 2**64 first; A is odd, so shifting the prompt
index by g is the same as adding ``g * B / A`` to the seed."""


def shard_seed(seed: int, first_prompt: int) -> int:
    """The seed of a `generate` call over prompts ``first_prompt, ...`` of a batch seeded `seed`
    that draws the same per-request streams as the whole batch (module doc)."""
    return (seed + first_prompt * _PROMPT_STEP) & _MASK


def shard_bounds(num_prompts: int, num_shards: int) -> list[tuple[int, int]]:
    """`num_shards` contiguous ``[start, end)`` prompt ranges whose sizes differ by at most one
    (the first ones larger); empty shards are dropped."""
    if num_shards < 1:
        raise ConfigError(f"rollout.shards={num_shards} must be >= 1")
    base, extra = divmod(num_prompts, num_shards)
    out, start = [], 0
    for s in range(num_shards):
        end = start + base + (1 if s < extra else 0)
        if end > start:
            out.append((start, end))
        start = end
    return out


def assign(num_shards: int, num_workers: int) -> list[list[int]]:
    """Shard indices per worker, round robin: worker w runs shards w, w + N, ..."""
    return [list(range(w, num_shards, num_workers)) for w in range(num_workers)]


def merge(bounds: Sequence[tuple[int, int]], parts: Sequence[list[Rollout]]) -> list[Rollout]:
    """The rollouts of every shard (in shard order) as one prompt-major list with batch-wide
    prompt indices."""
    out: list[Rollout] = []
    for (start, _), rollouts in zip(bounds, parts, strict=True):
        for r in rollouts:
            r.prompt_index += start
            out.append(r)
    return out
