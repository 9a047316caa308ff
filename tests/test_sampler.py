"""Sampler: processed distributions against a float64 sort-based reference, and sampling mechanics."""

from __future__ import annotations

import math

import pytest
import torch

from flashrl.core import sampling as sampler_module
from flashrl.core.sampling import SamplingParams, process_logits, replay_processed_logprobs
from flashrl.engine.sampler import sample


def reference_processed_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """float64, one row at a time, written from the rule: /T, keep >= k-th largest, drop the ascending
    prefix whose cumulative probability is <= 1 - p (never the most likely token), log-softmax."""
    out = []
    for row in logits.double():
        z = row / temperature
        if top_k > 0:
            kth = torch.sort(z, descending=True).values[top_k - 1]
            z = torch.where(z < kth, torch.tensor(-math.inf, dtype=z.dtype), z)
        if top_p < 1:
            order = torch.argsort(z)
            cum = torch.cumsum(torch.softmax(z[order], 0), 0)
            drop = cum <= 1 - top_p
            drop[-1] = False
            z = z.clone()
            z[order[drop]] = -math.inf
        out.append(torch.log_softmax(z, 0))
    return torch.stack(out)


CASES = [(0.7, 0, 1.0), (0.7, 5, 1.0), (0.7, 0, 0.9), (0.7, 5, 0.9), (1.0, 50, 0.5), (1.3, 0, 0.95)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
@pytest.mark.parametrize("vocab", [64, 3000])
def test_processed_logprobs_match_float64_reference(temperature, top_k, top_p, vocab, gen):
    logits = torch.randn(6, vocab, generator=gen) * 3
    got = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), -1)
    ref = reference_processed_logprobs(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "different truncated support"
    finite = torch.isfinite(ref)
    assert (got[finite].double() - ref[finite]).abs().max() < 2e-5


def test_top_p_falls_back_to_full_sort_for_flat_rows(gen, monkeypatch):
    """A flat distribution puts less than p of the mass in the candidates: the full sort handles it."""
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 8)
    logits = torch.randn(4, 100, generator=gen) * 0.01
    logits[0] *= 300  # one peaked row, covered by the candidates
    got = torch.log_softmax(process_logits(logits, 1.0, 0, 0.9), -1)
    ref = reference_processed_logprobs(logits, 1.0, 0, 0.9)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert (got[torch.isfinite(ref)].double() - ref[torch.isfinite(ref)]).abs().max() < 2e-5


def test_top_k_keeps_ties():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    processed = process_logits(logits, 1.0, top_k=2)
    assert torch.isfinite(processed).tolist() == [[True, True, True, False]]


def test_replay_gives_minus_inf_outside_support():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    lp = replay_processed_logprobs(logits, torch.tensor([3]), 1.0, top_k=2)
    assert lp.item() == -math.inf


def test_sample_returns_logprob_of_sampled_token_under_processed_distribution(gen):
    logits = torch.randn(32, 500, generator=gen) * 2
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, raw_logprobs=True)
    out = sample(logits, params, torch.rand(32, generator=gen, dtype=torch.float64))
    ref = reference_processed_logprobs(logits, 0.8, 40, 0.9)
    picked = ref.gather(1, out.tokens[:, None]).squeeze(1)
    assert torch.isfinite(picked).all(), "sampled outside the truncated support"
    assert (out.logprobs.double() - picked).abs().max() < 2e-5
    raw = torch.log_softmax(logits.double(), -1).gather(1, out.tokens[:, None]).squeeze(1)
    assert (out.raw_logprobs.double() - raw).abs().max() < 2e-5


def test_inverse_cdf_picks_the_right_token():
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]]))
    params = SamplingParams(temperature=1.0)
    picks = [
        sample(logits, params, torch.tensor([u], dtype=torch.float64)).tokens.item()
        for u in (0.0, 0.05, 0.11, 0.69, 0.71, 0.999999999)
    ]
    assert picks == [0, 0, 2, 2, 3, 3]  # never the zero-probability token 1


def test_greedy_is_argmax_with_unscaled_logprob(gen):
    logits = torch.randn(5, 50, generator=gen)
    out = sample(logits, SamplingParams(temperature=0))
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n="),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert SamplingParams(top_k=-1).top_k == 0
