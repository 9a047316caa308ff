"""How to sample, and the processed logprob: a token's logprob under the distribution sampled from.

Processing order (the same as vLLM's V1 sampler, so "processed" logprobs agree across engines):
fp32 logits -> temperature -> top-k -> top-p -> softmax -> sample. Top-k keeps the k largest logits
(ties at the k-th value are kept). Top-p sorts ascending and removes the tokens whose cumulative
probability is <= 1 - p, always keeping the most likely token. The logprob is
``log_softmax(processed logits)[token]`` in fp32: renormalised over the kept support. Greedy
(temperature 0) uses the log-softmax of the raw logits (no temperature), as vLLM does.

`process_logits` is the one definition of "processed"; the built-in engine samples from it
(`flashrl.engine.sampler.sample`) and `replay_processed_logprobs` recomputes the same quantity for
given tokens from full-sequence logits: the trainer uses it to replay the rollout's temperature and
truncation (mask replay).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from flashrl.errors import InputError

NEG_INF = float("-inf")


def is_integer(value: object) -> bool:
    """An int or a numpy integer; not a bool, not a float (2.0 is refused rather than truncated)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def is_real(value: object) -> bool:
    """An int or float (numpy's included); not a bool, not a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Validated on construction; errors name the field and the allowed range."""

    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens with cumulative probability >= top_p; 1
    disables."""
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
        """Check every field's type and range (an `InputError` naming the field and what is allowed)
        and normalise numbers to plain Python types: a float where a float is meant
        (``temperature=1`` is fine), an int where an int is meant (``n=2.0`` is refused, not
        truncated)."""
        self._number("temperature", lambda x: x >= 0, "a number >= 0 (0 is greedy)")
        self._integer("top_k", lambda x: x >= -1, "an integer >= 0 (0 or -1 disables)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._number("top_p", lambda x: 0 < x <= 1, "a number in (0, 1]")
        self._integer("max_tokens", lambda x: x >= 1, "an integer >= 1")
        self._integer("n", lambda x: x >= 1, "an integer >= 1")
        if self.seed is not None:
            self._integer("seed", lambda x: True, "an integer or None")
        for name in ("ignore_eos", "logprobs", "raw_logprobs"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                self._fail(name, "True or False")
            object.__setattr__(self, name, bool(getattr(self, name)))
        stop = self.stop_token_ids
        if isinstance(stop, torch.Tensor | np.ndarray):
            stop = stop.tolist()
        iterable = isinstance(stop, Iterable) and not isinstance(stop, str | bytes)
        stop = list(stop) if iterable else None
        if stop is None or not all(is_integer(t) and t >= 0 for t in stop):
            self._fail("stop_token_ids", "a list of token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))

    def _fail(self, name: str, allowed: str) -> None:
        value = getattr(self, name)
        raise InputError(f"SamplingParams.{name}={value!r} is invalid; allowed: {allowed}")

    def _number(self, name: str, ok: Callable[[float], bool], allowed: str) -> None:
        value = getattr(self, name)
        if not is_real(value) or not math.isfinite(value) or not ok(value):
            self._fail(name, allowed)
        object.__setattr__(self, name, float(value))

    def _integer(self, name: str, ok: Callable[[int], bool], allowed: str) -> None:
        value = getattr(self, name)
        if not is_integer(value) or not ok(value):
            self._fail(name, allowed)
        object.__setattr__(self, name, int(value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p remove tokens (the trainer must then replay the truncation)."""
        return self.top_k > 0 or self.top_p < 1


# ------------------------------------------------------------------------------------------------
# processing: temperature -> top-k -> top-p (the definition of "processed")
# ------------------------------------------------------------------------------------------------

TOP_P_CANDIDATES = 1024
"""Top-p first looks at this many most likely tokens; when they hold at least p of the mass (the
usual case) the nucleus lies among them and no full-vocabulary sort is needed. Exact either way."""


def _top_k_mask_(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask logits below the k-th largest value in place (ties with the k-th value are kept)."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits.masked_fill_(logits < kth, NEG_INF)
    return logits


def _top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Remove tokens whose ascending cumulative probability is <= 1 - top_p (the most likely token
    always stays): vLLM's rule. Rows whose top candidates hold >= p of the mass are resolved among
    the candidates; the outside mass is added as the starting cumulative value, which gives exactly
    the full-sort result because every outside token's cumulative value is <= 1 - p."""
    if top_p >= 1:
        return logits
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    log_z = torch.logsumexp(flat, dim=-1, keepdim=True)
    k = min(TOP_P_CANDIDATES, vocab)
    values, index = flat.topk(k, dim=-1)  # descending
    probs = (values - log_z).exp()
    inside = probs.sum(-1, keepdim=True)
    cum_ascending = (1 - inside) + probs.flip(-1).cumsum(-1)  # ascending order over candidates
    remove = (cum_ascending <= 1 - top_p).flip(-1)
    remove[:, 0] = False
    covered = (inside >= top_p).squeeze(-1) | (k == vocab)
    result = torch.full_like(flat, NEG_INF)
    result.scatter_(-1, index, values.masked_fill(remove, NEG_INF))
    if not bool(covered.all()):  # rare: a very flat distribution; sort those rows fully
        rows = (~covered).nonzero().squeeze(-1)
        sorted_vals, sorted_idx = flat[rows].sort(dim=-1)
        cum = sorted_vals.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        kept = sorted_vals.masked_fill(drop, NEG_INF)
        result[rows] = torch.full_like(sorted_vals, NEG_INF).scatter(-1, sorted_idx, kept)
    return result.view_as(logits)


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The logits actually sampled from, fp32: ``logits / T`` with top-k and top-p applied as -inf.
    Temperature 0 (greedy) leaves the logits unscaled."""
    out = logits.float() / temperature if temperature > 0 else logits.float().clone()
    if temperature > 0:
        out = _top_k_mask_(out, top_k)
        out = _top_p_mask(out, top_p)
    return out


def replay_processed_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """fp32 logprobs of `tokens` [...] under the processed distribution of `logits` [..., V].

    The trainer calls this with its own logits to replay the rollout's temperature and truncation;
    a token outside the truncated support gets -inf.
    """
    processed = process_logits(logits, temperature, top_k, top_p)
    return torch.log_softmax(processed, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
