"""The built-in engine against `transformers` on tiny random checkpoints loaded through the real loader.

Tolerances: fp32 engine logits equal transformers' to 1e-4 absolute (measured: 0, the same ops in the
same order); bf16 logits to 0.05 absolute (bf16 rounding through two layers; measured about 0.02).
Logprobs: against a float64 recomputation of the processed distribution from transformers' fp32
logits of the full sequence, 1e-4 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from flashrl.engine import Engine, SamplingParams
from flashrl.errors import CheckpointError, WeightError
from flashrl.testing import FAMILIES, save_tiny_model
from shorthand import build_engine
from test_sampler import reference_processed_logprobs

VARIANTS = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("qwen3", {"attention_bias": True}),  # transformers gives o_proj a bias too
]
ROPE_VARIANTS = [
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
]


def hf_model(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    return build_engine(path, **kwargs)


def random_ids(length, gen, vocab=256):
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


@pytest.mark.parametrize(
    "family,overrides",
    VARIANTS + [("qwen2", r) for r in ROPE_VARIANTS] + [("mistral", {"sliding_window": 8})],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}" for k in v) or "default",
)
def test_logits_match_transformers(family, overrides, tiny_models, gen):
    path = tiny_models(family, **overrides)
    ids = torch.tensor([random_ids(40, gen)])
    with torch.no_grad():
        ref32 = hf_model(path)(ids).logits[0]
        ref16 = hf_model(path, torch.bfloat16)(ids).logits[0].float()
    assert (engine(path).logits(ids[0]) - ref32).abs().max() < 1e-4
    assert (engine(path, dtype="bf16").logits(ids[0]) - ref16).abs().max() < 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers_generate(family, tiny_models, gen):
    path = tiny_models(family)
    hf = hf_model(path)
    prompts = [random_ids(n, gen) for n in (3, 11, 7)]
    outs = engine(path, max_batch=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out.response_ids == ref[0, len(prompt) :].tolist()
        assert out.finish_reason == "length" and len(out.logprobs) == 24


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("mistral", {"sliding_window": 8})])
def test_incremental_decode_equals_full_forward(family, overrides, tiny_models, gen):
    """Greedy logprobs (log-softmax of the decode-step logits) equal a no-cache forward of the whole sequence."""
    e = engine(tiny_models(family, **overrides), max_batch=3)
    prompts = [random_ids(n, gen) for n in (4, 17, 9)]
    for out in e.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)):
        full = e.score(out.prompt_ids, out.response_ids, temperature=1.0)
        assert max(abs(a - b) for a, b in zip(out.logprobs, full)) < 1e-5


def test_batched_generation_equals_each_alone(tiny_models, gen):
    path = tiny_models("qwen2")
    prompts = [random_ids(n, gen) for n in (2, 13, 6, 9, 21)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = engine(path, max_batch=8).generate(prompts, greedy)
    single = engine(path, max_batch=1)
    for prompt, out in zip(prompts, batched):
        alone = single.generate([prompt], greedy)[0]
        assert out.response_ids == alone.response_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, alone.logprobs)) < 1e-5


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_models, gen):
    path = tiny_models("qwen3")
    prompts = [random_ids(n, gen) for n in (5, 8, 3)]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, n=3, seed=7)
    a = engine(path, max_batch=9).generate(prompts, params)
    b = engine(path, max_batch=2).generate(prompts, params)  # different scheduling and batch sizes
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [(r.prompt_index, r.sample_index) for r in a] == [
        (i, j) for i in range(3) for j in range(3)
    ]
    c = engine(path).generate(
        prompts, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, n=3, seed=8)
    )
    assert [r.response_ids for r in a] != [r.response_ids for r in c]
    assert len({tuple(r.response_ids) for r in a[:3]}) > 1, (
        "the n samples of a prompt should differ"
    )


def test_seeded_tokens_follow_each_requests_uniform_stream(tiny_models, gen):
    """Token t of request (i, j) is the inverse-CDF sample at uniform t of its own stream: the first
    `max_tokens` float64 draws of a generator seeded with stream_seed(seed, i, j)."""
    from flashrl.engine.sampler import sample, stream_seed

    e = engine(tiny_models("qwen2"), max_batch=3)
    params = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=12, n=2, seed=21, ignore_eos=True
    )
    for out in e.generate([random_ids(5, gen), random_ids(9, gen)], params):
        stream = torch.Generator().manual_seed(stream_seed(21, out.prompt_index, out.sample_index))
        uniforms = torch.rand(params.max_tokens, generator=stream, dtype=torch.float64)
        logits = e.cached_logits([out.prompt_ids], [out.response_ids])[0]
        assert (
            sample(logits, params, uniforms[: len(out.response_ids)]).tokens.tolist()
            == out.response_ids
        )


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (10, 1.0), (0, 0.8), (10, 0.8)])
def test_logprobs_equal_float64_recomputation(top_k, top_p, tiny_models, gen):
    path = tiny_models("qwen2")
    hf = hf_model(path)
    params = SamplingParams(
        temperature=0.7, top_k=top_k, top_p=top_p, max_tokens=25, n=2, seed=3, raw_logprobs=True
    )
    for out in engine(path).generate([random_ids(6, gen), random_ids(12, gen)], params):
        ids = torch.tensor([out.prompt_ids + out.response_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(out.prompt_ids) - 1 : -1]
        targets = torch.tensor(out.response_ids)
        ref = (
            reference_processed_logprobs(logits, 0.7, top_k, top_p)
            .gather(1, targets[:, None])
            .squeeze(1)
        )
        assert torch.isfinite(ref).all(), "a token outside the truncated support was sampled"
        assert (torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs().max() < 1e-4
        raw = torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)
        assert (torch.tensor(out.raw_logprobs, dtype=torch.float64) - raw).abs().max() < 1e-4


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile via Wilson-Hilferty; z = 3.719 is the 1e-4 one-sided normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_token_frequencies_match_processed_distribution(tiny_models, gen):
    """Pearson chi-square goodness of fit of 4000 first tokens against the processed distribution.
    With a fixed seed the test is deterministic; its false-failure rate as a random test is 1e-4."""
    path = tiny_models("qwen2")
    prompt = random_ids(5, gen)
    params = SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_tokens=1, n=4000, seed=11)
    outs = engine(path, max_batch=4000).generate([prompt], params)
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1:]
    probs = reference_processed_logprobs(logits, 0.7, 30, 0.9)[0].exp()
    counts = torch.bincount(
        torch.tensor([o.response_ids[0] for o in outs]), minlength=probs.numel()
    ).double()
    assert counts[probs == 0].sum() == 0, "sampled a token outside the support"
    support = probs > 0
    expected = probs[support] * len(outs)
    assert expected.min() > 1, "test design: every kept token should be expected at least once"
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert stat < chi2_critical(int(support.sum()) - 1), (
        f"chi2 {stat:.1f} over {int(support.sum())} tokens"
    )


def test_n_samples_share_one_prefill(tiny_models, gen):
    e = engine(tiny_models("llama"), max_batch=8)
    e.generate(
        [random_ids(10, gen), random_ids(10, gen)],
        SamplingParams(max_tokens=4, n=4, seed=0, ignore_eos=True),
    )
    assert e.stats()["prompt_tokens"] == 20  # two prompts prefilled once each, not eight times


def test_stop_tokens_and_eos(tiny_models, gen):
    e = engine(tiny_models("qwen2"))
    prompt = random_ids(4, gen)
    first = e.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[
        0
    ].response_ids
    stop = e.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first[3]], ignore_eos=True),
    )[0]
    assert stop.finish_reason == "stop" and stop.response_ids == first[: first.index(first[3]) + 1]
    e.eos_token_ids = (first[2],)
    eos = e.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    assert eos.finish_reason == "stop" and eos.response_ids[-1] == first[2]


def test_response_capped_by_max_len(tiny_models, gen):
    e = engine(tiny_models("qwen2"), max_len=16)
    out = e.generate(
        [random_ids(10, gen)], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )[0]
    assert len(out.response_ids) == 6 and out.finish_reason == "length"


# ---------------------------------------------------------------------------------------- weight sync

SCHEMES = ["bf16", "int8", "fp8", "fp8_channel", "fp8_block", "int8_g128", "int8_g64"]


def perturbed_state(path, gen, scale=0.05):
    hf = hf_model(path)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for tensor in state.values():
        tensor.add_(
            torch.randn(tensor.shape, generator=gen)
            * scale
            * (tensor.std() if tensor.numel() > 1 else 1)
        )
    return hf, state


def save_state(hf, state, path):
    hf.load_state_dict(state)
    hf.save_pretrained(path)
    return path


def pointers(e: Engine) -> dict[str, int]:
    return {
        n: t.data_ptr() for n, t in list(e.model.named_buffers()) + list(e.model.named_parameters())
    }


@pytest.mark.parametrize("scheme", SCHEMES)
def test_update_weights_equals_fresh_engine(scheme, tiny_models, tmp_path, gen):
    base = tiny_models("qwen2", tie_word_embeddings=False)
    hf, state = perturbed_state(base, gen)
    perturbed = save_state(hf, state, tmp_path / "perturbed")
    e = engine(base, rollout_config=scheme)
    before = pointers(e)
    ids = random_ids(20, gen)
    timing = e.update_weights(
        ((k, v) for k, v in reversed(list(state.items()))), count_changed=True
    )
    assert pointers(e) == before, "storage moved during update_weights"
    assert torch.equal(e.logits(ids), engine(perturbed, rollout_config=scheme).logits(ids))
    assert timing["requantize_s"] >= 0 and timing["tensors"] == len(state)
    if scheme != "bf16":
        assert 0 < timing["codes_changed_frac"] <= 1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partial_and_split_qkv_updates(scheme, tiny_models, tmp_path, gen):
    base = tiny_models("qwen2", tie_word_embeddings=False)
    hf, state = perturbed_state(base, gen)
    original = {k: v.clone() for k, v in hf_model(base).state_dict().items()}
    layer0 = "model.layers.0.self_attn."
    changed = {
        k: state[k]
        for k in (
            layer0 + "q_proj.weight",
            layer0 + "k_proj.weight",
            layer0 + "v_proj.weight",
            layer0 + "k_proj.bias",
            "model.layers.1.mlp.up_proj.weight",
        )
    }
    expected = save_state(hf, {**original, **changed}, tmp_path / "expected")
    e = engine(base, rollout_config=scheme)
    for name in (layer0 + "v_proj.weight", layer0 + "q_proj.weight"):  # q, k, v in separate calls
        e.update_weights([(name, changed[name])])
    e.update_weights(
        {
            layer0 + "k_proj.weight": changed[layer0 + "k_proj.weight"],
            layer0 + "k_proj.bias": changed[layer0 + "k_proj.bias"],
        }
    )
    e.update_weights(
        [("model.layers.1.mlp.up_proj.weight", changed["model.layers.1.mlp.up_proj.weight"])]
    )
    ids = random_ids(20, gen)
    assert torch.equal(e.logits(ids), engine(expected, rollout_config=scheme).logits(ids))


def test_tied_embedding_update_reaches_the_head(tiny_models, gen):
    path = tiny_models("qwen2")  # tied
    e = engine(path)
    new = torch.randn(256, 64, generator=gen) * 0.02
    e.update_weights([("model.embed_tokens.weight", new)])
    assert torch.equal(e.model.lm_head.weight, new) and torch.equal(
        e.model.embed_tokens.weight, new
    )
    e32 = engine(path, dtype="bf16", lm_head_fp32=True)
    e32.update_weights([("model.embed_tokens.weight", new)])
    assert e32.model.lm_head.weight.dtype == torch.float32 and torch.equal(
        e32.model.lm_head.weight, new
    )


def test_lm_head_fp32_reduces_logit_error(tiny_models, gen):
    path = tiny_models("qwen2", tie_word_embeddings=False)
    ids = random_ids(30, gen)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    err_bf16 = (engine(path, dtype="bf16").logits(ids) - ref).abs().mean()
    err_fp32_head = (engine(path, dtype="bf16", lm_head_fp32=True).logits(ids) - ref).abs().mean()
    assert err_fp32_head < err_bf16


def test_bad_updates_leave_engine_unchanged(tiny_models, gen):
    path = tiny_models("qwen2")
    e = engine(path, rollout_config="int8")
    ids = random_ids(10, gen)
    before = e.logits(ids)
    good = ("model.layers.0.mlp.down_proj.weight", torch.randn(64, 128, generator=gen))
    with pytest.raises(WeightError, match="unexpected tensor 'model.layers.0.mlp.fc1.weight'"):
        e.update_weights([good, ("model.layers.0.mlp.fc1.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"shape \(64, 127\); expected \(64, 128\)"):
        e.update_weights([good, ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 127))])
    with pytest.raises(WeightError, match="dtype torch.int8; allowed: float32"):
        e.update_weights(
            [("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 128, dtype=torch.int8))]
        )
    assert torch.equal(e.logits(ids), before)


# ---------------------------------------------------------------------------------------- bad input


def test_bad_model_dirs(tmp_path, tiny_models):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine(tmp_path)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(gpt2)
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'gpt2'; supported: LlamaForCausalLM"
    ):
        Engine(gpt2)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_models("qwen2") / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        Engine(empty)


def test_missing_tensor_in_checkpoint(tmp_path, gen):
    path = save_tiny_model(tmp_path / "m", "llama")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.down_proj.weight"
    ):
        Engine(path)


def test_sharded_checkpoint_loads(tmp_path, gen):
    path = tmp_path / "sharded"
    hf = hf_model(save_tiny_model(tmp_path / "single", "qwen3"))
    hf.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    ids = random_ids(12, gen)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (engine(path).logits(ids) - ref).abs().max() < 1e-4


def test_prompt_errors(tiny_models):
    e = engine(tiny_models("qwen2"), max_len=16)
    with pytest.raises(ValueError, match="prompt 1 has 16 tokens; max_len=16"):
        e.generate([[5, 6], list(range(3, 19))])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        e.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.generate([[5, 999]])
    with pytest.raises(ValueError, match="no tokenizer"):
        e.generate(["hello"])


# ---------------------------------------------------------------------------------------- prefill budget, progress


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_prefill_token_budget_splits_forwards_not_results(scheme, tiny_models, gen):
    """A budget of 20 padded tokens over prompts of 2, 13, 6, 9, 21 and 4 tokens (2 samples each, all
    slots free): forwards [2], [13], [6, 9] (2 x 9 = 18), [21] (alone, over the budget), [4]. Outputs
    equal one prefill of everything (per-token activations: the split changes nothing but GEMM row
    counts)."""
    path = tiny_models("qwen2")
    prompts = [random_ids(n, gen) for n in (2, 13, 6, 9, 21, 4)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, n=2, seed=5, ignore_eos=True)
    whole = engine(path, rollout_config=scheme, max_batch=12)
    split = engine(path, rollout_config=scheme, max_batch=12, max_prefill_tokens=20)
    a, b = whole.generate(prompts, params), split.generate(prompts, params)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs)) < 1e-5
    assert whole.stats()["prefill_forwards"] == 1 and split.stats()["prefill_forwards"] == 5
    assert split.stats()["prompt_tokens"] == whole.stats()["prompt_tokens"] == 55


def test_prefill_token_budget_validation(tiny_models):
    for bad in (0, -3, 1.5, True, "16"):
        with pytest.raises(
            ValueError, match="max_prefill_tokens=.* is invalid; allowed: an integer >= 1"
        ):
            engine(tiny_models("qwen2"), max_prefill_tokens=bad)


def test_progress_bar_reports_tokens_per_s_before_any_sequence_finishes(
    tiny_models, gen, monkeypatch, capsys
):
    """Fixed-length generations finish together at the end; the bar must still show tok_s while they run
    (the clock is faked: every perf_counter call advances 0.75 s, so the 2 s delay passes at once)."""
    import itertools
    import time

    e = engine(tiny_models("qwen2"), progress=True)
    clock = itertools.count(0.0, 0.75)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    e.generate([random_ids(4, gen)] * 2, SamplingParams(max_tokens=8, seed=0, ignore_eos=True))
    frames = capsys.readouterr().err.split("\r")
    assert any("0/2" in f and "tok_s=" in f for f in frames), frames
    quiet = engine(tiny_models("qwen2"), progress=False)
    quiet.generate([random_ids(4, gen)] * 2, SamplingParams(max_tokens=8, seed=0, ignore_eos=True))
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------- attention


def reference_attention(q, k, v, mask):
    """float64 softmax(q k^T / sqrt(D) + mask) v with K/V repeated per query head (GQA by definition)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (28, 4)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attend_equals_float64_reference(heads, kv_heads, dtype, tol, gen):
    """Decode (grouped form) over strided cache slices with per-row lengths, a padding row that sees
    key 0 only and a sliding window; prefill (causal). bf16 tolerance: output rounding (2^-8 relative)."""
    from flashrl.model.batch import attention_mask
    from flashrl.model.decoder import attend

    b, d, max_len, s = 5, 32, 40, 24
    cache_k, cache_v = (
        torch.randn(b + 2, kv_heads, max_len, d, generator=gen).to(dtype) for _ in range(2)
    )
    k, v = cache_k[:b, :, :s], cache_v[:b, :, :s]  # views, as KVCache.read returns them
    q = torch.randn(b, heads, 1, d, generator=gen).to(dtype)
    positions = torch.tensor([[23], [0], [10], [17], [5]])
    for window in (None, 6):
        mask = attention_mask(positions, s, window)
        got = attend(q, k, v, mask, d**-0.5)
        assert got.shape == (b, heads, 1, d) and got.dtype == dtype
        assert (got.double() - reference_attention(q, k, v, mask)).abs().max() < tol
    prompt_q = torch.randn(2, heads, 9, d, generator=gen).to(dtype)
    got = attend(prompt_q, k[:2, :, :9], v[:2, :, :9], None, d**-0.5)
    assert (
        got.double() - reference_attention(prompt_q, k[:2, :, :9], v[:2, :, :9], None)
    ).abs().max() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_attention_never_takes_the_math_kernel(tiny_models, gen):
    """With SDPA's math kernel disabled, prefill (causal: flash, GQA) and decode (grouped form with a mask:
    memory-efficient or cuDNN) still run, eager at exact shapes and bucketed; logprobs match an fp32 engine."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path = tiny_models("qwen2")  # 4 heads over 2 kv heads
    prompts = [random_ids(n, gen) for n in (3, 17, 8)]
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=0, ignore_eos=True)
    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    reference = engine(path, device="cuda")
    for buckets in (False, True):
        e = engine(path, dtype="bf16", device="cuda", max_batch=8, decode_buckets=buckets)
        with sdpa_kernel(fast):
            outs = e.generate(prompts, params)
        for r in outs:
            scored = reference.score(r.prompt_ids, r.response_ids, temperature=0.9)
            assert max(abs(x - y) for x, y in zip(r.logprobs, scored)) < 0.1  # bf16 vs fp32 engine
