"""Two flashrl vLLM engines in one process keep separate state, and flashrl keeps nothing of a
deleted engine alive.

The plugin's counters, staged layers and log-once sets live in one `ModelState` per engine (made by
the engine's quantization config) and on its layers (`flashrl.vllm_backend.model_state`). Before,
they were module globals: a second engine's start-up load, direct loads and incomplete groups
showed in the first engine's stats, one engine's embedding load repacked the other's LM head, the
kernel choice was logged once per process, and the kernel registry kept every engine's kernels
(and through them its layers) for the life of the process.

Tiny random Qwen2 (q/k/v biases, tied embeddings), in-process engines, ``enforce_eager=True``.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()

# Imported here, not on first use inside a test: vLLM's lazy import keeps frames of its importer
# alive (and with them the importer's locals, an engine included).
from vllm import LLM, SamplingParams  # noqa: E402

from flashrl.vllm_backend import WeightUpdater, engine_kwargs, kernels  # noqa: E402
from flashrl.vllm_backend.model_state import state_of  # noqa: E402
from flashrl.vllm_backend.testing import (  # noqa: E402
    load_state_dict,
    save_perturbed_copy,
    save_tiny_vllm_model,
)

LLM_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0, max_num_seqs=8)
GREEDY = dict(temperature=0, max_tokens=4, ignore_eos=True)
Q, K = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
QUANTIZED = tuple(
    f"{p}.weight"
    for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_state")
    base = save_tiny_vllm_model(
        root / "base",
        family="qwen2",
        seed=0,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        dtype=torch.bfloat16,
    )
    perturbed = save_perturbed_copy(base, root / "perturbed", scale=0.2, seed=1)
    return {"base": base, "perturbed_sd": load_state_dict(perturbed)}


def make_llm(path):
    return LLM(str(path), **engine_kwargs("int8"), **LLM_ARGS)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def model_of(llm):
    return llm.apply_model(lambda model: model)[0]


def rpc(llm, method: str) -> dict[str, float]:
    return llm.collective_rpc(method)[0]


def generate(llm) -> None:
    llm.generate(["Hello world"], SamplingParams(**GREEDY), use_tqdm=False)


def quantized_layers(llm) -> int:
    return sum(hasattr(m, "flashrl_kernel_id") for m in model_of(llm).modules())


def messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_two_engines_keep_separate_stats_staging_and_logs(checkpoints, caplog):
    new = checkpoints["perturbed_sd"]
    with caplog.at_level(logging.INFO, logger="flashrl"):
        a = make_llm(checkpoints["base"])
        b = make_llm(checkpoints["base"])
    try:
        assert len(messages(caplog, "flashrl_int8: ")) == 2, "each engine logs its kernel choice"
        n = quantized_layers(a)
        assert n > 0 and state_of(model_of(a)) is not state_of(model_of(b))
        # Start-up loads: each engine counts its own layers, not the other's too.
        assert rpc(a, "flashrl_pop_requantize_stats")["layers_requantized"] == n
        assert rpc(b, "flashrl_pop_requantize_stats")["layers_requantized"] == n

        model_a = model_of(a)
        for name, tensor in new.items():  # TRL: one tensor per call, embedding included
            model_a.load_weights([(name, tensor)])
        model_a.load_weights([(Q, new[Q]), (K, new[K])])  # q and k without v: incomplete
        loads_a, loads_b = rpc(a, "flashrl_load_stats"), rpc(b, "flashrl_load_stats")
        assert loads_a["layers_requantized"] == n and loads_a["pending_layers"] == 1
        staged = [name for name in new if name.endswith(QUANTIZED)]  # not norms, biases, embedding
        assert loads_a["direct_tensors"] == len(staged) + 2
        assert set(loads_b.values()) == {0}, loads_b
        assert rpc(a, "flashrl_pop_requantize_stats")["layers_requantized"] == n
        assert rpc(b, "flashrl_pop_requantize_stats")["layers_requantized"] == 0

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flashrl"):
            generate(b)  # B has nothing staged and no new embedding
        assert not messages(caplog, "incomplete weight update"), "B reported A's layer"
        assert not messages(caplog, "repacked the CPU LM-head"), "A's embedding load repacked B"
        assert rpc(a, "flashrl_load_stats")["incomplete_groups"] == 0
        with caplog.at_level(logging.INFO, logger="flashrl"):
            generate(a)
        assert len(messages(caplog, "incomplete weight update")) == 1
        assert len(messages(caplog, "repacked the CPU LM-head")) == 1
        assert rpc(a, "flashrl_load_stats")["incomplete_groups"] == 1
        assert rpc(b, "flashrl_load_stats")["incomplete_groups"] == 0

        stats = WeightUpdater(b).update_weights(new.items())  # B's update: B's layers only
        assert stats["layers_requantized"] == n
        assert rpc(a, "flashrl_load_stats")["pending_layers"] == 1, "A's staged shards are A's"
    finally:
        shutdown(a)
        shutdown(b)


def release_vllm_references(modules: list[weakref.ref]) -> None:
    """Drop vLLM 0.32's own references to a deleted engine's layers: ``LAYERWISE_INFO`` (a
    WeakKeyDictionary) keeps each online-quantized layer's restore metadata, whose wrapped weight
    loader (``online_process_loader``) closes over the layer, so the entry never goes (vLLM's own
    online fp8 method does the same). What flashrl holds must not keep anything alive after this."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for ref in modules:
        module = ref()
        if module is not None:
            LAYERWISE_INFO.pop(module, None)


def start_and_delete(base, new) -> tuple[dict[str, weakref.ref], list[int], list[weakref.ref]]:
    """Build an engine on vLLM's kernels, stage a shard, delete it; weak references only."""
    llm = make_llm(base)
    model = model_of(llm)
    layers = [m for m in model.modules() if hasattr(m, "flashrl_kernel_id")]
    assert all(m.flashrl_kernel is not None for m in layers), "vLLM's kernel was not attached"
    model.load_weights([(K, new[K])])
    staged = model.model.layers[1].self_attn.qkv_proj
    assert staged._flashrl_staging is not None
    watched = {
        "ModelState": weakref.ref(state_of(model)),
        "a quantized layer": weakref.ref(staged),
        "its KernelState": weakref.ref(staged.flashrl_kernel),
        "its staged shards": weakref.ref(staged._flashrl_staging),
    }
    handles = [m.flashrl_kernel_id for m in layers]
    modules = [weakref.ref(m) for m in model.modules()]
    shutdown(llm)
    return watched, handles, modules


def test_nothing_of_a_deleted_engine_stays_alive(checkpoints, monkeypatch):
    """Once the engine is deleted (and vLLM's own references are dropped), its `ModelState`,
    layers, kernel states and staged shards are freed, and its kernel handles resolve to nothing.
    The probe is opened so that every layer holds a vLLM kernel on every CPU."""
    monkeypatch.setattr(kernels, "PROBE_TOLERANCE_INT8", float("inf"))
    # pytest's log capture keeps the records of a test, args included, and vLLM logs its engine
    # config (which holds the quantization config, and so the ModelState): render them at once.
    factory = logging.getLogRecordFactory()

    def rendered(*args, **kwargs) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.msg, record.args = record.getMessage(), ()
        return record

    logging.setLogRecordFactory(rendered)
    try:
        watched, handles, modules = start_and_delete(
            checkpoints["base"], checkpoints["perturbed_sd"]
        )
    finally:
        logging.setLogRecordFactory(factory)
    gc.collect()
    release_vllm_references(modules)
    gc.collect()
    alive = [what for what, ref in watched.items() if ref() is not None]
    assert not alive, f"still alive after the engine was deleted: {alive}"
    for handle in handles:
        with pytest.raises(KeyError):
            kernels.lookup(handle)
