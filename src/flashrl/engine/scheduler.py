"""Continuous batching over KV-cache slots: the queue, admission, slots and finish checks.

Requests wait in a queue; a prompt's `n` samples form a group that is admitted together when
enough slots are free (a group larger than the cache is split). The prompt is prefilled once and
its K/V copied to the other samples' slots. Every decode step advances all active sequences; a
finished sequence frees its slot, the last active sequence moves into it (so the active set is
always slots 0..B-1) and waiting prompts are admitted. One long response therefore does not idle
the batch.

Prefill token budget: one prefill forward holds at most `max_prefill_tokens` padded prompt tokens
(groups x longest prompt), like vLLM's ``max_num_batched_tokens``: the admitted prompts are split
over several forwards, so activation memory (e.g. an int8 GEMM's int32 accumulator of [tokens,
2 x intermediate]) stays bounded at large batches of long prompts. A single prompt longer than the
budget is prefilled alone.

The scheduler owns the requests and their slots, never a tensor: the engine runs each `Step` it
hands out (`flashrl.engine.runner`), and `postprocess` tells it which slots to move.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashrl.core.sampling import SamplingParams
from flashrl.engine.sampler import SampledTokens, SamplingTables


@dataclass
class Request:
    """One sample (prompt `prompt_index`, sample `sample_index`) of a `generate` call."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    index: int
    """This request's row in `tables`."""
    tables: SamplingTables
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


@dataclass
class Step:
    """The next forward: a prefill of `groups` into slots from `first_slot` on, or (no groups) a
    decode step of every request in `requests` (request b in slot b)."""

    requests: list[Request]
    groups: list[list[Request]]
    first_slot: int = 0

    @property
    def is_prefill(self) -> bool:
        return bool(self.groups)


class Scheduler:
    """Queue -> active slots -> done, for one `generate` call (module docstring)."""

    def __init__(self, max_batch: int, max_prefill_tokens: int) -> None:
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.queue: deque[list[Request]] = deque()
        self.active: list[Request] = []
        """Running requests; request b owns KV-cache slot b."""
        self.done: list[Request] = []

    def add(self, group: list[Request]) -> None:
        """Queue the samples of one prompt (split when there are more than `max_batch`)."""
        for start in range(0, len(group), self.max_batch):
            self.queue.append(group[start : start + self.max_batch])

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.active)

    def schedule(self) -> Step:
        """Admit waiting groups into free slots (a prefill step), else decode the active set."""
        first_slot = len(self.active)
        groups = self._admit(self.max_batch - first_slot)
        if not groups:
            return Step(requests=list(self.active), groups=[])
        requests = [r for g in groups for r in g]
        self.active.extend(requests)
        return Step(requests=requests, groups=groups, first_slot=first_slot)

    def _admit(self, free_slots: int) -> list[list[Request]]:
        """Pop the waiting groups that the next prefill forward takes: in order, while their samples
        fit in `free_slots` and the padded prompt tokens (groups x longest prompt) stay within
        `max_prefill_tokens` (the first group always goes, however long its prompt)."""
        admitted: list[list[Request]] = []
        width = 0
        while self.queue and len(self.queue[0]) <= free_slots:
            new_width = max(width, len(self.queue[0][0].prompt_ids))
            if admitted and new_width * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            group = self.queue.popleft()
            admitted.append(group)
            free_slots -= len(group)
            width = new_width
        return admitted

    def postprocess(
        self, stop_ids: set[int], move_slot: Callable[[int, int, int], None]
    ) -> list[Request]:
        """Finish the active requests whose last token is a stop token or that reached their
        length, free their slots (``move_slot(src, dst, length)`` moves the last active sequence
        into a freed slot) and return them."""
        finished = [k for k, r in enumerate(self.active) if _finish(r, stop_ids)]
        for k in reversed(finished):
            self.done.append(self.active[k])
            last = len(self.active) - 1
            if k != last:
                move_slot(last, k, self.active[last].cache_len + 1)
                self.active[k] = self.active[last]
            self.active.pop()
        return self.done[len(self.done) - len(finished) :]


def _finish(request: Request, stop_ids: set[int]) -> bool:
    if request.finish_reason is not None:
        return True
    if request.response[-1] in stop_ids:
        request.finish_reason = "stop"
    elif len(request.response) >= request.max_new:
        request.finish_reason = "length"
    return request.finish_reason is not None


def sample_into(
    requests: list[Request], logits: torch.Tensor, params: SamplingParams, record: bool = False
) -> SampledTokens | None:
    """Sample one token for each request from its row of `logits` (the requests' own random
    streams) and append it to the request's response. With `record` (someone observes the
    sampling), returns the step as a `SampledTokens`; else None, so the decode loop builds nothing
    it does not need."""
    steps = [len(r.response) for r in requests]
    out = requests[0].tables.sample(logits, params, [r.index for r in requests], steps)
    tokens = out.tokens.tolist()
    for r, token in zip(requests, tokens):
        r.response.append(token)
    if not record:
        return None
    return SampledTokens(
        prompt_index=tuple(r.prompt_index for r in requests),
        sample_index=tuple(r.sample_index for r in requests),
        step=tuple(steps),
        logits=logits,
        tokens=tuple(tokens),
        logprobs=out.logprobs,
    )
