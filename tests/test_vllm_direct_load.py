"""Direct ``model.load_weights`` into a flashrl-quantized vLLM engine, as RL trainers call it.

TRL colocate and OpenRLHF send one Hugging Face-named tensor per call, verl all tensors in one
call (shared/reference/vllm.md section 2.2b); neither starts vLLM's layerwise reload. For every
scheme, each pattern must leave the engine bit-identical to a fresh engine loaded from the new
checkpoint (codes, scales, biases, norms, embeddings, generated tokens and logprobs), in the same
storages. A NaN tensor is refused before its layer changes, and an incomplete fused group keeps the
layer's previous weights whole and is reported (warning + counter).

Tiny random Qwen2 (q/k/v biases, tied embeddings: the CPU LM-head repack is exercised), head_dim 32
for vLLM's CPU attention, in-process engines with ``enforce_eager=True``.
"""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()

from flashrl.errors import WeightError  # noqa: E402
from flashrl.vllm_backend import engine_kwargs  # noqa: E402
from flashrl.vllm_backend.direct_load import load_stats  # noqa: E402
from flashrl.vllm_backend.testing import load_state_dict, save_perturbed_copy, save_tiny_vllm_model  # noqa: E402

QUANT_SCHEMES = ("int8", "fp8", "fp8_channel", "fp8_block", "int8_g64")
PROMPTS = ["Hello world", "The quick brown fox", "1+1="]
LLM_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0, max_num_seqs=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct_load")
    dims = dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )
    base = save_tiny_vllm_model(root / "base", family="qwen2", seed=0, **dims)
    perturbed = save_perturbed_copy(base, root / "perturbed", scale=0.2, seed=1)
    return {
        "base": base,
        "perturbed": perturbed,
        "base_sd": load_state_dict(base),
        "perturbed_sd": load_state_dict(perturbed),
    }


def make_llm(path, scheme):
    return vllm.LLM(str(path), **engine_kwargs(scheme), **LLM_ARGS)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def model_of(llm):
    return llm.apply_model(lambda model: model)[0]


def snapshot(llm) -> dict[str, torch.Tensor]:
    """Clones of every parameter and buffer of the model (codes, scales, biases, norms, embeddings)."""
    model = model_of(llm)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return {name: t.detach().clone() for name, t in tensors.items()}


def storages(llm) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in model_of(llm).named_parameters()}


def outputs(llm):
    """Greedy and seeded sampled tokens with processed logprobs (the LM head is exercised)."""
    llm.reset_prefix_cache()
    results = []
    for params in (
        vllm.SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True),
        vllm.SamplingParams(
            temperature=0.8, n=2, seed=5, max_tokens=10, logprobs=0, ignore_eos=True
        ),
    ):
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            for c in out.outputs:
                results.append(
                    (list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)])
                )
    return results


def assert_same(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        a, e = actual[name], expected[name]
        same = (
            torch.equal(a.view(torch.uint8), e.view(torch.uint8))
            if a.dtype != e.dtype or a.element_size() == 1
            else torch.equal(a, e)
        )
        assert a.dtype == e.dtype and same, f"{what}: {name} differs from a fresh load"


def per_tensor_shuffled(state_dict):
    """TRL colocate / OpenRLHF: one tensor per call, here in a random order."""
    items = list(state_dict.items())
    random.Random(0).shuffle(items)
    return [[item] for item in items]


def all_at_once(state_dict):
    """verl: every tensor in one call."""
    return [list(state_dict.items())]


def qkv_split(state_dict):
    """q, k and v of each layer in separate calls, with other layers' tensors in between."""
    items = list(state_dict.items())
    first = [i for i in items if ".q_proj." in i[0] or ".gate_proj." in i[0]]
    rest = [i for i in items if i not in first]
    return [[i] for i in first] + [[i] for i in rest]


def verl_buckets(state_dict):
    """verl's current sharding manager: buckets of a few tensors, a q/k/v or gate/up group split
    across two buckets (the final `process_weights_after_loading` call is made by the test)."""
    items = list(state_dict.items())
    return [items[i : i + 5] for i in range(0, len(items), 5)]


PATTERNS = {
    "per_tensor_shuffled": per_tensor_shuffled,
    "all_at_once": all_at_once,
    "qkv_split": qkv_split,
    "verl_buckets": verl_buckets,
}


@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
def test_direct_load_patterns_equal_a_fresh_load(checkpoints, scheme):
    fresh = {}
    for which in ("base", "perturbed"):
        llm = make_llm(checkpoints[which], scheme)
        fresh[which] = (snapshot(llm), outputs(llm))
        shutdown(llm)

    llm = make_llm(checkpoints["base"], scheme)
    model = model_of(llm)
    addresses = storages(llm)
    target = "perturbed"
    for name, pattern in PATTERNS.items():
        for call in pattern(checkpoints[f"{target}_sd"]):
            model.load_weights(call)
        if name == "verl_buckets":
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            config = llm.llm_engine.vllm_config.model_config
            process_weights_after_loading(model, config, next(model.parameters()).device)
        assert_same(snapshot(llm), fresh[target][0], f"{scheme}/{name}")
        assert outputs(llm) == fresh[target][1], (
            f"{scheme}/{name}: generation differs from a fresh engine"
        )
        assert storages(llm) == addresses, f"{scheme}/{name}: a parameter moved to a new storage"
        target = "base" if target == "perturbed" else "perturbed"
    assert load_stats(model)["pending_layers"] == 0
    shutdown(llm)


@pytest.fixture(scope="module")
def int8_llm(checkpoints):
    llm = make_llm(checkpoints["base"], "int8")
    yield llm
    shutdown(llm)


@pytest.mark.parametrize("bad", ["nan", "inf", "int32"])
def test_bad_tensor_is_refused_before_the_layer_changes(checkpoints, int8_llm, bad):
    model = model_of(int8_llm)
    before = snapshot(int8_llm)
    new = checkpoints["perturbed_sd"]
    name = "model.layers.1.self_attn.o_proj.weight"
    tensor = new[name].clone()
    if bad == "int32":
        tensor = tensor.to(torch.int32)
    else:
        tensor[3, 5] = float(bad)
    with pytest.raises(WeightError, match=r"layers\.1\.self_attn\.o_proj"):
        model.load_weights([(name, tensor)])
    qname = "model.layers.0.self_attn.q_proj.weight"
    bad_q = new[qname].clone()
    bad_q[0, 0] = float("nan")
    model.load_weights(
        [("model.layers.0.self_attn.k_proj.weight", new["model.layers.0.self_attn.k_proj.weight"])]
    )
    with pytest.raises(WeightError, match=r"layers\.0\.self_attn\.qkv_proj.*'q'"):
        model.load_weights([(qname, bad_q)])
    assert_same(snapshot(int8_llm), before, f"after a refused {bad} tensor")
    # The good k shard stays staged; completing the group with the old weights restores the layer.
    for part in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.0.self_attn.{part}.weight"
        model.load_weights([(key, checkpoints["base_sd"][key])])
    assert load_stats(model)["pending_layers"] == 0
    assert_same(snapshot(int8_llm), before, "after completing the group")


def test_incomplete_fused_group_keeps_old_weights_and_is_reported(checkpoints, int8_llm, caplog):
    model = model_of(int8_llm)
    before = snapshot(int8_llm)
    new = checkpoints["perturbed_sd"]
    incomplete_before = load_stats(model)["incomplete_groups"]
    for part in ("q_proj", "k_proj"):
        key = f"model.layers.1.self_attn.{part}.weight"
        model.load_weights([(key, new[key])])
    model.load_weights(
        [("model.layers.1.mlp.gate_proj.weight", new["model.layers.1.mlp.gate_proj.weight"])]
    )
    assert_same(snapshot(int8_llm), before, "after an incomplete group")
    assert load_stats(model)["pending_layers"] == 2
    with caplog.at_level(logging.WARNING, logger="flashrl"):
        outputs(int8_llm)
    messages = [
        r.getMessage() for r in caplog.records if "incomplete weight update" in r.getMessage()
    ]
    assert any("layers.1.self_attn.qkv_proj" in m and "'v'" in m for m in messages), messages
    assert any("layers.1.mlp.gate_up_proj" in m and "'1'" in m for m in messages), messages
    assert load_stats(model)["incomplete_groups"] == incomplete_before + 2
    outputs(int8_llm)  # reported once per incomplete state, not at every step
    assert load_stats(model)["incomplete_groups"] == incomplete_before + 2
    # Completing the groups with the old weights restores the engine exactly.
    for key in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    ):
        model.load_weights([(key, checkpoints["base_sd"][key])])
    assert load_stats(model)["pending_layers"] == 0
    assert_same(snapshot(int8_llm), before, "after completing the groups with the old weights")


QUANTIZED_WEIGHTS = tuple(
    f"{p}.weight"
    for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


def count_full_checks(monkeypatch) -> list[int]:
    """Count `check_incoming` calls that scan a tensor for NaN/Inf (every caller looks it up on the
    module at call time)."""
    from flashrl.vllm_backend import direct_load

    counter, check = [0], direct_load.check_incoming

    def counted(tensor, name, finite=True):
        counter[0] += bool(finite)
        check(tensor, name, finite)

    monkeypatch.setattr(direct_load, "check_incoming", counted)
    return counter


def test_every_load_path_checks_each_tensor_once(checkpoints, int8_llm, monkeypatch):
    """At most one finiteness scan per incoming tensor: a direct load scans each tensor of a layer
    flashrl's methods own on arrival (norms go through vLLM's own loader, unscanned); WeightUpdater
    scans every tensor before sending and its loaders do not again; vLLM's layerwise reload scans
    once (not in its element-counting dry run), and a quantized layer's weights not at all: the
    quantizer's own amax pass refuses NaN/Inf (next test). Exception: biases, which vLLM keeps off
    the meta device, so its dry run already writes them into the live parameter; they are scanned
    in both calls (one vector per layer)."""
    from flashrl.vllm_backend import WeightUpdater

    checks = count_full_checks(monkeypatch)
    model = model_of(int8_llm)
    perturbed, base = checkpoints["perturbed_sd"], checkpoints["base_sd"]
    quantized = [n for n in base if n.endswith(QUANTIZED_WEIGHTS)]
    norms = [n for n in base if n.endswith("norm.weight")]
    biases = [n for n in base if n.endswith(".bias")]
    assert len(quantized) == 7 * 2 and len(norms) == 2 * 2 + 1 and len(biases) == 3 * 2
    owned = len(base) - len(norms)
    for name, tensor in perturbed.items():
        model.load_weights([(name, tensor)])
    assert checks[0] == owned, "TRL per-tensor load"
    checks[0] = 0
    WeightUpdater(int8_llm).update_weights(base.items())
    assert checks[0] == len(base), "WeightUpdater.update_weights"
    checks[0] = 0
    int8_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(perturbed.items())})
    assert checks[0] == owned - len(quantized) + len(biases), "reload_weights"
    checks[0] = 0
    model.load_weights(list(base.items()))
    assert checks[0] == owned, "verl: one load_weights call"
    int8_llm.reset_prefix_cache()


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_layerwise_reload_refuses_a_non_finite_quantized_weight(checkpoints, bad):
    """In vLLM's layerwise reload a quantized layer's weight is scanned by the quantizer only; a
    NaN/Inf in it is still refused, naming the layer."""
    llm = make_llm(checkpoints["base"], "int8")
    try:
        state = dict(checkpoints["perturbed_sd"])
        name = "model.layers.1.self_attn.k_proj.weight"
        state[name] = state[name].clone()
        state[name][2, 3] = float(bad)
        with pytest.raises(
            WeightError,
            match=r"layers\.1\.self_attn\.qkv_proj: weight: .*1 non-finite value",
        ):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
    finally:
        shutdown(llm)
