"""`direct_load.check_incoming`, the gate every tensor passes before it reaches a vLLM layer (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from flashrl.errors import WeightError
from flashrl.vllm_backend.direct_load import check_incoming
from flashrl.vllm_backend.model_state import ModelState


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_values_are_refused_with_a_count(value, dtype):
    tensor = torch.randn(6, 7).to(dtype)
    tensor[4, 2] = value
    with pytest.raises(
        WeightError, match=r"layer\.w: refusing a tensor with 1 NaN/Inf value\(s\) of 42"
    ):
        check_incoming(tensor, "layer.w")


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.ones(3, dtype=torch.int32), "dtype torch.int32; weights must be floating point"),
        (torch.empty(3, device="meta"), "meta device"),
        ([1.0, 2.0], "expected a torch.Tensor, got list"),
    ],
)
def test_wrong_kinds_of_tensor_are_refused(bad, match):
    with pytest.raises(WeightError, match=match):
        check_incoming(bad, "layer.w")


def test_finite_tensors_pass():
    check_incoming(torch.randn(4, 4, dtype=torch.bfloat16), "layer.w")
    check_incoming(torch.empty(0), "layer.w")


def test_finite_false_checks_the_type_only():
    tensor = torch.full((3,), float("nan"))
    check_incoming(tensor, "layer.w", finite=False)  # the quantizer scans it instead
    with pytest.raises(WeightError, match="weights must be floating point"):
        check_incoming(torch.ones(3, dtype=torch.int32), "layer.w", finite=False)


def test_prechecked_tensors_are_not_scanned_again_and_the_mark_ends_with_the_block():
    state = ModelState()
    checked, other = torch.randn(4), torch.randn(4)
    param, meta = torch.empty(4), torch.empty(4, device="meta")
    assert state.needs_check(param, checked) and not state.needs_check(meta, checked)  # dry run
    with state.prechecked([checked]):
        assert not state.needs_check(param, checked)
        assert state.needs_check(param, other) and state.needs_check(param, checked[:2])  # views
        with state.prechecked([other]):
            assert not state.needs_check(param, other) and not state.needs_check(param, checked)
        assert state.needs_check(param, other)
    assert state.needs_check(param, checked)
