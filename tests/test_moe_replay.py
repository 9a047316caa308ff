"""Routing capture in the engine and routing replay in the trainer's `transformers` forward.

Tolerances: with replay, a fp32 trainer's logprobs of rollouts from an fp32 engine with the bf16
(unquantized) scheme equal the engine's to 1e-5 absolute (fp32 rounding: attention and GEMMs sum in
another order; measured <= 1e-6), even when every router's logits are tied to within 1e-6 relative,
where the engine's decode and the trainer's full forward pick other experts without replay
(measured up to 0.02).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from flashrl.engine import SamplingParams
from flashrl.engine.routing import RoutingBackend, RoutingCapture
from flashrl.errors import ConfigError, UnsupportedError
from flashrl.rl.batch import Batch, response_logprobs
from flashrl.rl.routing_replay import ReplayBatch, build_batch, replay_backend, replay_routing
from flashrl.testing import MOE_FAMILIES, save_tiny_model
from shorthand import build_engine


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    kwargs.setdefault("max_batch", 16)
    return build_engine(path, **kwargs)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(gen, lengths=(5, 9, 13, 7)):
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


PARAMS = SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=1, ignore_eos=True)


@pytest.fixture(scope="module")
def tied_router_model(tmp_path_factory):
    """A tiny Qwen3-MoE whose router rows are all equal up to 1e-6 relative noise: every token's
    top-2 is decided by rounding."""
    path = save_tiny_model(tmp_path_factory.mktemp("tied"), "qwen3_moe", seed=3)
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "experts"):
                w = layer.mlp.gate.weight
                noise = torch.randn(w.shape, generator=gen) * w[0].abs().mean() * 1e-6
                w.copy_(w[0] + noise)
    hf.save_pretrained(path)
    return path


def trainer_logprobs(path, rollouts):
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), torch.device("cpu"))
    hf = hf_model(path)
    with torch.no_grad():
        plain, _ = response_logprobs(hf, batch, PARAMS)
        with replay_routing(hf, batch.routed_experts):
            replayed, _ = response_logprobs(hf, batch, PARAMS)
    return batch, plain, replayed


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_capture_records_every_position(family, tiny_models, gen):
    """[prompt + response - 1, MoE layers, k] ids per rollout; the samples of a prompt share the
    prompt's rows; at fp32 the ids equal transformers' routing of the same sequence wherever the
    k-th and (k+1)-th probabilities are not within 1e-5."""
    path = tiny_models(family)
    e = engine(path)
    backend = RoutingBackend(e)
    rollouts = backend.generate(prompts(gen), PARAMS)
    moe = e.model_config.moe
    hf = hf_model(path)
    for r in rollouts:
        p, n = len(r.prompt_ids), len(r.response_ids)
        assert r.routed_experts.shape == (p + n - 1, len(moe.sparse_layers), moe.top_k)
        assert r.routed_experts.dtype == torch.int16
        ref, probs = [], []

        def record(module, args, out, ref=ref, probs=probs):
            ref.append(out[2])
            probs.append(out[0].softmax(-1))

        hooks = [
            layer.mlp.gate.register_forward_hook(record)
            for layer in hf.model.layers
            if hasattr(layer.mlp, "experts")
        ]
        with torch.no_grad():
            hf(torch.tensor([r.prompt_ids + r.response_ids[:-1]]))
        for h in hooks:
            h.remove()
        for layer, (ids, pr) in enumerate(zip(ref, probs)):
            top = pr.sort(-1, descending=True).values
            clear = top[:, moe.top_k - 1] - top[:, moe.top_k] > 1e-5
            assert torch.equal(r.routed_experts[clear, layer].long(), ids[clear])
    for a, b in zip(rollouts[::2], rollouts[1::2]):
        p = len(a.prompt_ids)
        assert torch.equal(a.routed_experts[:p], b.routed_experts[:p])


def test_capture_with_bucketed_decode_and_errors(tiny_models, gen):
    path = tiny_models("qwen3_moe")
    plain = RoutingBackend(engine(path)).generate(prompts(gen), PARAMS)
    bucketed = RoutingBackend(engine(path, decode_buckets=True)).generate(
        [r.prompt_ids for r in plain[::2]], PARAMS
    )
    for a, b in zip(plain, bucketed):
        assert a.response_ids == b.response_ids
        assert a.routed_experts.shape == b.routed_experts.shape
    with pytest.raises(UnsupportedError, match="needs an MoE model"):
        RoutingCapture(engine(tiny_models("qwen2")))
    with pytest.raises(UnsupportedError, match="decode_compile"):
        RoutingCapture(engine(path, decode_compile="default"))
    with pytest.raises(ConfigError, match="built-in engine"):
        replay_backend(object(), None)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_own_routing_changes_nothing(family, tiny_models, gen):
    """Replaying the ids transformers picks itself gives bit-identical logprobs and gradients
    (the weights are recomputed by the family's rule, exactly as the router computes them)."""
    path = tiny_models(family)
    hf = hf_model(path)
    rollouts = RoutingBackend(engine(path)).generate(prompts(gen), PARAMS)
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), torch.device("cpu"))
    assert isinstance(batch, ReplayBatch) and isinstance(batch.select(slice(0, 2)), ReplayBatch)
    own = []

    def record(module, args, out):
        own.append(out[2])

    hooks = [
        layer.mlp.gate.register_forward_hook(record)
        for layer in hf.model.layers
        if hasattr(layer.mlp, "experts")
    ]
    plain, _ = response_logprobs(hf, batch, PARAMS)
    plain.sum().backward()
    grad = hf.model.layers[0].mlp.gate.weight.grad.clone()
    for h in hooks:
        h.remove()
    hf.zero_grad()
    n, width = batch.input_ids.shape
    routed = torch.stack([ids.view(n, width, -1) for ids in own], dim=2)
    with replay_routing(hf, routed):
        replayed, _ = response_logprobs(hf, batch, PARAMS)
    replayed.sum().backward()
    assert torch.equal(plain, replayed)
    assert torch.equal(grad, hf.model.layers[0].mlp.gate.weight.grad)
    assert isinstance(Batch.build(rollouts, torch.zeros(len(rollouts)), "cpu"), Batch)


def test_replay_matches_engine_with_tied_routers(tied_router_model, gen):
    """bf16-scheme rollouts (fp32 engine): with replay the trainer's logprobs equal the engine's
    to fp32 rounding although every router is tied to 1e-6; without replay other experts are
    picked and the logprobs move."""
    rollouts = RoutingBackend(engine(tied_router_model)).generate(prompts(gen), PARAMS)
    batch, plain, replayed = trainer_logprobs(tied_router_model, rollouts)
    mask = batch.response_mask
    replay_err = (replayed - batch.rollout_logprobs)[mask].abs().max().item()
    plain_err = (plain - batch.rollout_logprobs)[mask].abs().max().item()
    assert replay_err < 1e-5, replay_err
    assert plain_err > 100 * max(replay_err, 1e-7), (plain_err, replay_err)


def test_capture_with_split_prefills_and_groups(tiny_models, gen):
    """Prefills split by the token budget and groups split by the cache (n > max_batch): every
    rollout still gets its full routing; samples prefilled together share the prompt's rows (a
    group of 3 in a cache of 2 is prefilled as samples 0-1, then 2)."""
    path = tiny_models("qwen3_moe")
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=2, ignore_eos=True)
    e = engine(path, max_batch=2, max_prefill_tokens=8)
    rollouts = RoutingBackend(e).generate(prompts(gen, (5, 9, 3)), params)
    assert e.stats()["prefill_forwards"] >= 6
    for r in rollouts:
        assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.response_ids) - 1
    for first in (0, 3, 6):
        a, b = rollouts[first], rollouts[first + 1]
        p = len(a.prompt_ids)
        assert torch.equal(a.routed_experts[:p], b.routed_experts[:p])
