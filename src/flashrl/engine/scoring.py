"""Teacher-forced scoring and KV-cache diagnostics: given responses, the logits the engine computes
for them, and how far the engine's KV cache (e.g. fp8) moves them.

`teacher_forced` computes logits as `generate` computes them: a prefill of the prompts, then one
decode step per response token reading the KV cache (so fp8 KV rounding is included). The steps
run eagerly at their exact shapes whatever ``decode_compile`` and ``decode_buckets`` say (those
change the logits only by float rounding; docs/engine.md). The `Engine` methods `cached_logits`,
`kv_cache_mismatch` and `score` check their inputs and call these functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from flashrl.engine.kv_cache import KVCache
from flashrl.engine.runner import ModelRunner

Pairs = Sequence[tuple[list[int], list[int]]]
"""Checked (prompt ids, response ids) pairs."""


def teacher_forced(
    runner: ModelRunner, cache: KVCache, pairs: Pairs
) -> Iterator[tuple[int, torch.Tensor, list[int]]]:
    """Yield (t, logits [rows, vocab], rows) for t = 0, 1, ...: the logits predicting response
    token t of the sequences `rows` (those whose response is longer than t), with the prompts in
    slots 0..len(pairs)-1 of `cache` and response tokens fed one decode step at a time."""
    lengths = [len(p) for p, _ in pairs]
    logits = runner.prefill(cache, [p for p, _ in pairs], range(len(pairs)))
    for t in range(max(len(r) for _, r in pairs)):
        rows = [row for row, (_, r) in enumerate(pairs) if len(r) > t]
        if t:
            # feed response token t-1 at position len(prompt) + t - 1; finished rows repeat their
            # last position (their outputs are ignored and their slot is their own)
            positions = [
                min(lengths[row] + t - 1, lengths[row] + len(r) - 1)
                for row, (_, r) in enumerate(pairs)
            ]
            tokens = [r[min(t - 1, len(r) - 1)] for _, r in pairs]
            logits = runner.decode_eager(cache, tokens, positions)
        yield t, logits[rows], rows


def cached_logits(
    runner: ModelRunner, cache: KVCache, pairs: Pairs, max_batch: int
) -> list[torch.Tensor]:
    """fp32 logits [len(response), vocab] predicting each token of each response, through
    `cache` (`max_batch` pairs at a time)."""
    out: list[list[torch.Tensor]] = [[] for _ in pairs]
    for start in range(0, len(pairs), max_batch):
        chunk = pairs[start : start + max_batch]
        for _, logits, rows in teacher_forced(runner, cache, chunk):
            for row, logit in zip(rows, logits):
                out[start + row].append(logit)
    return [torch.stack(rows) for rows in out]


def reference_cache(runner: ModelRunner, slots: int, max_len: int) -> KVCache:
    """An unquantized cache (activation dtype) of `slots` slots for `runner`'s model."""
    c, model = runner.model.config, runner.model
    return KVCache(
        c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim, model.dtype, runner.device
    )


def kv_cache_mismatch(
    runner: ModelRunner, cache: KVCache, pairs: Pairs, max_batch: int, temperature: float
) -> dict[str, float]:
    """How far `cache` (e.g. fp8) moves the sampling distribution against an unquantized cache
    (activation dtype) on the same weights, teacher-forced on `pairs`. Per response token, at
    `temperature`:

    - ``kl``, ``kl_max``: exact KL(pi_kv || pi_ref) of the full next-token distributions (the
      rollout-vs-reference direction of `flashrl.correction`'s ``kl``), mean and max;
    - ``k3_kl``: the k3 estimate of the same KL from the given tokens (`k3_kl`);
    - ``logprob_abs_diff_max``, ``logit_abs_diff_max``; ``tokens``.
    """
    kls: list[torch.Tensor] = []
    lp_kv = torch.zeros(len(pairs), max(len(r) for _, r in pairs))  # logprobs of the given tokens
    lp_ref = torch.zeros_like(lp_kv)
    mask = torch.zeros_like(lp_kv, dtype=torch.bool)
    logit_diff = 0.0
    for start in range(0, len(pairs), max_batch):
        chunk = pairs[start : start + max_batch]
        ref = reference_cache(runner, len(chunk), max(len(p) + len(r) for p, r in chunk))
        steps = zip(teacher_forced(runner, cache, chunk), teacher_forced(runner, ref, chunk))
        for (t, a, rows), (_, b, _) in steps:
            la, lb = torch.log_softmax(a / temperature, -1), torch.log_softmax(b / temperature, -1)
            kls.append((la.exp() * (la - lb)).sum(-1))
            logit_diff = max(logit_diff, float((a - b).abs().max()))
            targets = torch.tensor([chunk[row][1][t] for row in rows], device=runner.device)
            idx = torch.tensor([start + row for row in rows])
            lp_kv[idx, t] = la.gather(1, targets[:, None])[:, 0].cpu()
            lp_ref[idx, t] = lb.gather(1, targets[:, None])[:, 0].cpu()
            mask[idx, t] = True
    kl = torch.cat(kls)
    return {
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "k3_kl": k3_kl(lp_ref, lp_kv, mask),
        "logprob_abs_diff_max": float((lp_kv - lp_ref).abs()[mask].max()),
        "logit_abs_diff_max": logit_diff,
        "tokens": float(mask.sum()),
    }


def k3_kl(lp_ref: torch.Tensor, lp_kv: torch.Tensor, mask: torch.Tensor) -> float:
    """The k3 estimate of KL(pi_kv || pi_ref) from the sampled tokens: the mean over `mask` of
    ``exp(d) - 1 - d`` with ``d = lp_ref - lp_kv`` (0 on padding), the ``k3_kl`` of
    `flashrl.correction`'s metrics with the reference as the trainer side."""
    delta = torch.where(mask, lp_ref - lp_kv, 0.0)
    return float((torch.expm1(delta) - delta).sum() / mask.sum().clamp_min(1))
