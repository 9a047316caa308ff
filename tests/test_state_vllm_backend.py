"""Where the vLLM plugin keeps state (no vLLM needed): per engine in a `ModelState`, per layer on
the layer, and module-level only for the documented kinds (machine-fact caches, the GEMM op's weak
handle index, process-wide once flags). tests/test_vllm_engine_state.py checks the same with
real engines."""

from __future__ import annotations

import ast
import copy
import gc
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashrl
from flashrl.vllm_backend import kernels
from flashrl.vllm_backend.kernels import KernelState
from flashrl.vllm_backend.model_state import ModelState, state_of

SRC = Path(flashrl.__file__).parent

MODULE_STATE = {
    "vllm_backend/kernels.py": {"_range_errors", "_by_handle", "_next_handle"},
    "vllm_backend/plugin.py": {"_registered"},
    "quant/gemm.py": {"_warned_reference"},
}
"""The module-level private names allowed in the vLLM plugin and the GEMM module, each documented
where it is defined: `_range_errors` caches a machine fact, `_by_handle` /
`_next_handle` are the weak index the GEMM custom op needs (a torch op carries integers, not
objects), `_registered` and `_warned_reference` are process-wide once flags."""


def module_state(path: Path) -> dict[str, bool]:
    """Module-level assignments to private lower-case names (the ``^_[a-z_]* *[:=]`` of a grep):
    name -> whether a docstring follows the assignment."""
    body = ast.parse(path.read_text()).body
    found = {}
    for node, after in zip(body, [*body[1:], None]):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Name) and target.id[:2] != "__" and target.id[0] == "_":
                if target.id[1:].replace("_", "").islower():
                    found[target.id] = (
                        isinstance(after, ast.Expr)
                        and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)
                    )
    return found


def test_vllm_backend_has_no_module_state_but_the_documented_kinds():
    paths = [*sorted((SRC / "vllm_backend").glob("*.py")), SRC / "quant" / "gemm.py"]
    found = {str(p.relative_to(SRC)): module_state(p) for p in paths}
    for rel, names in found.items():
        assert set(names) == MODULE_STATE.get(rel, set()), f"{rel}: module-level state {names}"
        undocumented = [n for n, documented in names.items() if not documented]
        assert not undocumented, f"{rel}: say why {undocumented} is module-level (a docstring)"


def test_the_module_state_checker_finds_a_global(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('_cache = {}\n"""why"""\n_count: int = 0\nCONST = 1\n__all__ = []\n')
    assert module_state(source) == {"_cache": True, "_count": False}


def test_vllm_kernel_handles_go_with_their_owner_and_are_never_reused():
    """The GEMM op's integer handle resolves to a `KernelState` only while its owner (the layer)
    holds it, and a later kernel never gets a freed kernel's handle."""
    owner = SimpleNamespace(flashrl_kernel=kernels.register(KernelState(object(), "int8")))
    handle = kernels.handle_of(owner.flashrl_kernel)
    assert kernels.lookup(handle) is owner.flashrl_kernel and handle >= 0
    assert kernels.handle_of(None) == -1 and kernels.kernel_name(-1) == "flashrl"
    del owner
    gc.collect()
    with pytest.raises(KeyError):
        kernels.lookup(handle)
    later = [kernels.register(KernelState(object(), "int8")) for _ in range(3)]
    assert all(k.handle > handle for k in later)
    assert [kernels.lookup(k.handle) for k in later] == later


def test_vllm_model_state_counters_pop_and_log_once():
    state = ModelState()
    state.note_quantized("int8", 0.25)
    state.note_quantized("int8", 0.5)
    state.count_direct_tensor()
    state.count_requantized(0.125)
    assert state.pop_requantize_stats() == {"requantize_s": 0.75, "layers_requantized": 2}
    assert state.pop_requantize_stats() == {"requantize_s": 0.0, "layers_requantized": 0}
    assert state.unlogged == {"layers": 2, "seconds": 0.75, "schemes": {"int8"}}
    assert state.load_stats(reset=True)["direct_tensors"] == 1
    assert state.load_stats() == {
        "direct_tensors": 0,
        "layers_requantized": 0,
        "incomplete_groups": 0,
        "requantize_s": 0.0,
        "pending_layers": 0.0,
    }
    assert state.log_once(("int8", "flashrl")) and not state.log_once(("int8", "flashrl"))
    assert ModelState().log_once(("int8", "flashrl")), "another engine logs its own choice"


def test_vllm_model_state_copies_start_empty():
    """vLLM pickles its config (which holds the engine's state) into the engine processes before
    any layer exists; a copy never shares or carries another model's state."""
    state = ModelState()
    layer = torch.nn.Linear(2, 2)
    state.pending.add(layer)
    state.note_quantized("fp8", 1.0)
    state.count_embedding_load()
    for copied in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
        assert isinstance(copied, ModelState) and copied is not state
        assert copied.pop_requantize_stats()["layers_requantized"] == 0
        assert len(copied.pending) == 0 and copied.embedding_loads == 0
    assert len(state.pending) == 1 and state.embedding_loads == 1


def test_vllm_state_of_finds_the_state_the_layers_share():
    state = ModelState()
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2))
    model[1].quant_method = SimpleNamespace(state=state)
    assert state_of(model) is state
    bare = torch.nn.Sequential(torch.nn.Linear(2, 2))
    empty = state_of(bare)
    assert empty.load_stats()["direct_tensors"] == 0 and empty is not state_of(bare)
