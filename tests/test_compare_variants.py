"""`run.compare` variant names (`compare_variants`): schemes, unquantized dtypes and -notis."""

from __future__ import annotations

import pytest

from flashrl.errors import ConfigError
from flashrl.rl.compare import compare_variants


def test_unquantized_dtypes_and_bf16():
    assert compare_variants("fp32") == [
        ("fp32", {"rollout.quant": "bf16", "rollout.dtype": "fp32"})
    ]
    assert compare_variants("FP16") == [
        ("fp16", {"rollout.quant": "bf16", "rollout.dtype": "fp16"})
    ]
    assert compare_variants("bf16") == [
        ("bf16", {"rollout.quant": "bf16", "rollout.dtype": "bf16"})
    ]
    assert compare_variants("int8") == [("int8", {"rollout.quant": "int8"})]


def test_notis_turns_the_importance_weight_off():
    assert compare_variants(" fp32-notis , int8-notis,") == [
        (
            "fp32-notis",
            {"rollout.quant": "bf16", "rollout.dtype": "fp32", "correction.weight": "none"},
        ),
        ("int8-notis", {"rollout.quant": "int8", "correction.weight": "none"}),
    ]
    names = [name for name, _ in compare_variants("fp32,fp32-notis,bf16")]
    assert names == ["fp32", "fp32-notis", "bf16"]


def test_a_variant_twice_is_an_error():
    with pytest.raises(ConfigError, match=r"lists 'fp32' twice \('FP32' and 'fp32'\)"):
        compare_variants("FP32,fp32")
    with pytest.raises(ConfigError, match="twice"):
        compare_variants("fp16-notis,FP16-notis")


def test_unknown_and_empty_names():
    with pytest.raises(ConfigError, match="run.compare='int3'") as info:
        compare_variants("int3")
    assert "fp32" in str(info.value) and "fp16" in str(info.value)
    with pytest.raises(ConfigError, match="needs at least one scheme"):
        compare_variants(" , ")


def test_stochastic_rounding_suffix():
    """``-sr`` sets stochastic sync rounding, combines with ``-notis`` in either order under one
    canonical name, and anything else after a scheme is refused, naming the allowed suffixes."""
    variants = dict(compare_variants("bf16-sr,int8-notis-sr,fp32-sr"))
    assert variants["bf16-sr"] == {
        "rollout.quant": "bf16",
        "rollout.dtype": "bf16",
        "rollout.sync_rounding": "stochastic",
    }
    assert variants["int8-sr-notis"]["correction.weight"] == "none"
    assert variants["int8-sr-notis"]["rollout.sync_rounding"] == "stochastic"
    assert "rollout.sync_rounding" in variants["fp32-sr"]
    with pytest.raises(ConfigError, match="twice"):
        compare_variants("int8-sr-notis,INT8-notis-sr")
    for bad in ("int8-xx", "int8-sr-sr"):
        with pytest.raises(
            ConfigError, match="allowed after a scheme, once each: -sq, -sr, -notis"
        ):
            compare_variants(bad)


def test_smoothing_suffix():
    """``-sq`` turns on online smoothing (exponent 0.5) under one canonical name in any order."""
    variants = dict(compare_variants("int8_g64-notis-sq"))
    assert variants["int8_g64-sq-notis"] == {
        "rollout.quant": "int8_g64",
        "correction.weight": "none",
        "rollout.smooth": 0.5,
    }
