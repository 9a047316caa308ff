"""The parts behind the `Engine` facade: the scheduler, padded batches, the KV-scale state, the
stats schema every backend fills, the sample observer hook and the k3 estimate of the KV
diagnostics. Engines are tiny fp32 CPU models (no downloads)."""

from __future__ import annotations

import pytest
import torch

from flashrl.core.rollout import BACKEND_STATS, BACKEND_STATS_KEYS
from flashrl.correction import mismatch_metrics
from flashrl.engine import SamplingParams
from flashrl.engine.generation import build_requests
from flashrl.engine.sampler import SampledTokens, SamplingTables
from flashrl.engine.scheduler import Scheduler
from flashrl.engine.scoring import k3_kl
from flashrl.model.batch import ForwardBatch, attention_mask, pad_right
from flashrl.model.kv_calibration import KVScales
from flashrl.model.kv_scales import KVScaleState
from shorthand import build_engine


def engine(path, **kwargs):
    return build_engine(path, dtype="fp32", device="cpu", progress=False, **kwargs)


def requests(lengths, n=1, max_tokens=4, max_len=64):
    params = SamplingParams(temperature=0, n=n, max_tokens=max_tokens)
    prompts = [[5] * length for length in lengths]
    tables = SamplingTables.build(lengths, params, 0, max_len, torch.device("cpu"))
    return list(build_requests(prompts, params, tables, max_len))


# ------------------------------------------------------------------------------- scheduler


def test_scheduler_admits_groups_within_slots_and_token_budget():
    sched = Scheduler(max_batch=4, max_prefill_tokens=20)
    for group in requests([6, 8, 3], n=2):
        sched.add(group)
    first = sched.schedule()  # 2 slots per group; 2 x 8 padded tokens fit in 20, 3 x 8 do not
    assert first.is_prefill and [len(g) for g in first.groups] == [2, 2] and first.first_slot == 0
    assert [r.prompt_index for r in sched.active] == [0, 0, 1, 1]
    for r in sched.active:
        r.response.append(7)
    assert not sched.schedule().is_prefill  # no free slot: a decode step of all four


def test_scheduler_splits_a_group_larger_than_the_cache():
    sched = Scheduler(max_batch=2, max_prefill_tokens=100)
    sched.add(requests([3], n=5)[0])
    assert [len(g) for g in sched.queue] == [2, 2, 1]


def test_postprocess_frees_slots_and_compacts_the_active_set():
    sched = Scheduler(max_batch=4, max_prefill_tokens=100)
    for group in requests([3, 3, 3], max_tokens=3):
        sched.add(group)
    sched.schedule()
    a, b, c = sched.active
    a.response, b.response, c.response = [9, 2], [9], [9, 9, 9]  # a: stop token 2; c: length
    moves = []
    finished = sched.postprocess({2}, lambda src, dst, length: moves.append((src, dst, length)))
    assert finished == [c, a] and (a.finish_reason, c.finish_reason) == ("stop", "length")
    # c (slot 2) is last: just dropped; a (slot 0) frees its slot and b moves from slot 1 into it
    assert sched.active == [b] and moves == [(1, 0, b.cache_len + 1)] and sched.done == [c, a]
    b.response.append(2)
    assert sched.postprocess({2}, lambda *m: moves.append(m)) == [b] and not sched.has_work


# ------------------------------------------------------------------------------- padded batches


def test_pad_right_and_forward_batch():
    padded = pad_right([[4, 5, 6], [7]])
    assert padded.ids.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert padded.valid.tolist() == [[True, True, True], [True, False, False]]
    assert padded.last.tolist() == [2, 0]
    plain = ForwardBatch.prefill(2, 3, "cpu", sliding_window=None)
    assert plain.mask is None and plain.positions.tolist() == [[0, 1, 2]] * 2
    windowed = ForwardBatch.prefill(2, 3, "cpu", sliding_window=2)
    assert torch.equal(windowed.mask, attention_mask(plain.positions, 3, 2))
    step = ForwardBatch.decode_step(
        torch.tensor([[2], [0]]), cache=None, kv_length=3, sliding_window=None
    )
    assert step.decode and step.mask[:, 0, 0].tolist() == [[True, True, True], [True, False, False]]


# ------------------------------------------------------------------------------- KV-scale state


def scales(value: float, tokens: int = 5) -> KVScales:
    t = torch.full((2, 1), value)
    return KVScales(k=t, v=t, k_amax=t, v_amax=t, tokens=tokens, margin=2.0)


def test_kv_scale_state_lifecycle():
    state = KVScaleState("fp8", "calibrated", "layer")
    assert state.calibrated and state.stale and state.initial() is None
    state.remember([[1, 2, 3], [4, 5]])
    assert state.calibration_set() == [[1, 2, 3], [4, 5]]
    assert state.record(scales(0.5), 0.25) == 0.25 and not state.stale
    assert torch.equal(state.initial()[0], torch.full((2, 1), 0.5))
    state.weights_changed()
    assert state.stale and state.stats() == {
        "kv_calibrations": 1,
        "kv_calibration_s": 0.25,
        "kv_calibration_last_s": 0.25,
        "kv_calibration_tokens": 5,
    }
    fixed = KVScaleState("fp8", 0.1, "layer")
    fixed.remember([[1]])
    fixed.weights_changed()
    assert not fixed.stale and len(fixed.recent) == 0
    assert float(fixed.initial()[1]) == pytest.approx(0.1)
    assert KVScaleState("bf16", "calibrated", None).initial() is None


# ------------------------------------------------------------------------------- the facade


def test_stats_hold_the_backend_schema(tiny_models):
    e = engine(tiny_models("qwen2"))
    before = e.stats()
    assert set(BACKEND_STATS_KEYS) <= before.keys() and before["tokens_per_s"] == 0.0
    params = SamplingParams(max_tokens=5, n=2, seed=1, ignore_eos=True)
    outs = e.generate([[5, 6, 7], [8, 9]], params)
    e.update_weights(e.random_weights(seed=1))
    s = e.stats()
    assert set(BACKEND_STATS) <= s.keys()
    assert (s["generate_calls"], s["prompts"], s["sequences"], s["weight_updates"]) == (1, 2, 4, 1)
    assert s["generated_tokens"] == sum(len(o.response_ids) for o in outs) == 20
    assert (
        s["prompt_tokens"] == 5
        and s["generate_s"] > 0
        and s["weight_update_s"] >= s["requantize_s"]
    )
    assert s["tokens_per_s"] == pytest.approx(s["generated_tokens"] / s["generate_s"])


def test_sample_observer_sees_every_sampled_token(tiny_models):
    e = engine(tiny_models("qwen2"), max_batch=3)
    seen: list[SampledTokens] = []
    remove = e.add_sample_observer(seen.append)
    params = SamplingParams(
        temperature=0.8, max_tokens=6, n=2, seed=3, stop_token_ids=list(range(3, 40))
    )
    outs = e.generate([[5, 6, 7], [8, 9], [10]], params)
    by_request = {(o.prompt_index, o.sample_index): o for o in outs}
    count = 0
    for record in seen:
        rows = len(record.tokens)
        assert record.logits.shape == (rows, 256) and record.logprobs.shape == (rows,)
        for k, key in enumerate(zip(record.prompt_index, record.sample_index)):
            rollout, step = by_request[key], record.step[k]
            assert rollout.response_ids[step] == record.tokens[k]
            assert rollout.logprobs[step] == float(record.logprobs[k])
            count += 1
    assert count == sum(len(o.response_ids) for o in outs)
    remove()
    e.generate([[5]], SamplingParams(max_tokens=2))
    assert sum(len(r.tokens) for r in seen) == count  # removed: nothing more recorded


def test_kv_k3_estimate_equals_the_correction_metric(gen):
    lp_ref = -torch.rand(3, 7, generator=gen) * 3
    lp_kv = lp_ref + torch.randn(3, 7, generator=gen) * 0.1
    mask = torch.rand(3, 7, generator=gen) > 0.3
    lp_ref, lp_kv = lp_ref * mask, lp_kv * mask
    expected = mismatch_metrics(lp_ref, lp_kv, mask)["k3_kl"]
    assert k3_kl(lp_ref, lp_kv, mask) == pytest.approx(expected, rel=1e-6)
