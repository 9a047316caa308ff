"""`Engine.update_weights` is all or nothing: a call with one bad tensor raises a `WeightError` naming
it and leaves every engine tensor bit-identical (codes, scales, norms, embeddings, biases), whatever
the scheme, wherever the bad tensor sits in the call and whatever is wrong with it."""

from __future__ import annotations

import pytest
import torch

from flashrl.engine import Engine, SamplingParams
from flashrl.errors import WeightError
from shorthand import build_engine

SCHEMES = ["bf16", "int8", "fp8", "fp8_channel", "fp8_block"]


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    kwargs.setdefault("max_len", 64)
    return build_engine(path, **kwargs)


def snapshot(e: Engine) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the engine's model (persistent or not), copied as raw bytes."""
    tensors = dict(e.model.named_parameters(remove_duplicate=False))
    tensors |= dict(e.model.named_buffers(remove_duplicate=False))
    return {name: t.detach().reshape(-1).view(torch.uint8).clone() for name, t in tensors.items()}


def pointers(e: Engine) -> dict[str, int]:
    return {
        n: t.data_ptr() for n, t in list(e.model.named_buffers()) + list(e.model.named_parameters())
    }


def good_tensors(e: Engine, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """Valid new values for a quantized shard, a whole layer, a norm, a bias and the embeddings:
    each would change the engine if it were applied."""
    names = [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.embed_tokens.weight",
    ]
    out = []
    for name in (n for n in names if n in e.weights.expected):
        shape = e.weights.shape_of(name)
        out.append(
            (name, torch.randn(shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
        )
    return out


def bad_tensors(e: Engine) -> list[tuple[str, str, torch.Tensor]]:
    """(what is wrong, name, tensor): each must be refused with an error naming `name`."""

    def shape(name):
        return e.weights.shape_of(name)

    def poisoned(name, value):
        t = torch.randn(shape(name)) * 0.05
        t.view(-1)[len(t.view(-1)) // 2] = value
        return t

    cases = []
    for target in (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.self_attn.k_proj.bias",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        cases.append(("NaN", target, poisoned(target, float("nan"))))
        cases.append(("Inf", target, poisoned(target, float("-inf"))))
    k = "model.layers.1.self_attn.k_proj.weight"
    cases += [
        ("meta", k, torch.empty(shape(k), device="meta")),
        ("shape", k, torch.zeros(shape(k)[0], shape(k)[1] + 1)),
        ("unknown", "model.layers.1.self_attn.kv_proj.weight", torch.zeros(shape(k))),
        ("out of range layer", "model.layers.7.self_attn.k_proj.weight", torch.zeros(shape(k))),
        ("int32", k, torch.zeros(shape(k), dtype=torch.int32)),
        ("bool", "model.norm.weight", torch.ones(shape("model.norm.weight"), dtype=torch.bool)),
        ("fp8", k, torch.zeros(shape(k), dtype=torch.float8_e4m3fn)),
        ("not a tensor", k, [[0.0] * shape(k)[1]] * shape(k)[0]),
    ]
    return cases


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bad_update_raises_and_leaves_engine_bit_identical(scheme, tiny_models, gen):
    e = engine(tiny_models("qwen2"), rollout_config=scheme)  # tied embeddings, q/k/v bias
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 9)]
    out_before = e.generate(prompts, params)
    before, where = snapshot(e), pointers(e)
    good = good_tensors(e, gen)
    for what, name, tensor in bad_tensors(e):
        with pytest.raises(WeightError, match=name.replace(".", r"\.")) as err:
            e.update_weights(good + [(name, tensor)])
        after = snapshot(e)
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        assert not changed, f"{what} in {name} ({err.value}): engine tensors changed: {changed}"
    assert pointers(e) == where
    assert e.stats()["weight_updates"] == 0
    out_after = e.generate(prompts, params)
    assert [o.response_ids for o in out_after] == [o.response_ids for o in out_before]
    assert [o.logprobs for o in out_after] == [o.logprobs for o in out_before]
    e.update_weights(good)  # the same good tensors alone still apply
    assert any(not torch.equal(before[n], t) for n, t in snapshot(e).items())


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_bad_tensor_first_or_in_the_middle(scheme, tiny_models, gen):
    """Order does not matter: the bad tensor is found before anything is written."""
    e = engine(tiny_models("qwen3"), rollout_config=scheme)  # q/k norm
    before = snapshot(e)
    good = good_tensors(e, gen)
    nan = torch.full((32,), float("nan"))
    for position in (0, 2, len(good)):
        items = (
            good[:position] + [("model.layers.0.self_attn.k_norm.weight", nan)] + good[position:]
        )
        with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight.*NaN"):
            e.update_weights(iter(items))  # a one-pass iterator, as a trainer's named_parameters()
        assert all(torch.equal(before[n], t) for n, t in snapshot(e).items())


def test_error_messages_say_what_is_allowed(tiny_models):
    e = engine(tiny_models("qwen2"))
    k = "model.layers.0.self_attn.k_proj.weight"
    cases = [
        (
            (k, torch.zeros(32, 64, dtype=torch.int32)),
            r"dtype torch\.int32.*float32, bfloat16, float16 or float64",
        ),
        ((k, torch.empty(32, 64, device="meta")), r"meta device.*no data"),
        ((k, torch.zeros(32, 65)), r"shape \(32, 65\); expected \(32, 64\)"),
        (
            (k, torch.full((32, 64), float("inf"))),
            r"2048 non-finite value\(s\) \(NaN or Inf\), first at index \(0, 0\)",
        ),
        (
            ("model.layers.0.self_attn.k_prj.weight", torch.zeros(32, 64)),
            r"unexpected tensor.*similar expected names",
        ),
    ]
    for (name, tensor), message in cases:
        with pytest.raises(WeightError, match=message):
            e.update_weights([(name, tensor)])
