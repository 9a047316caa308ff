"""Named CorrectionConfig presets: each equals the explicit config it stands for (verl's factory
methods, verl/trainer/config/algorithm.py), and the mode strings keep working next to them."""

from __future__ import annotations

import pytest

from flashrl.correction import PRESETS, CorrectionConfig

C = CorrectionConfig


@pytest.mark.parametrize(
    ("preset", "explicit"),
    [
        (C.disabled(), C(weight="none")),
        (C.disabled(mode="bypass"), C(mode="bypass", weight="none")),  # verl bypass_ppo_clip
        (C.token_tis(), C()),  # verl decoupled_token_is
        (C.token_tis(cap=3.0, batch_normalize=True), C(cap=3.0, batch_normalize=True)),
        (C.seq_tis(cap=5.0), C(weight="seq_tis", cap=5.0)),  # verl decoupled_seq_is
        (C.token_mis(), C(weight="token_mis", band=(0.5, 5.0))),  # verl decoupled_token_icepop
        (C.seq_mis(band=(0.2, 3.0)), C(weight="seq_mis", band=(0.2, 3.0))),
        (  # verl decoupled_seq_is_rs
            C.seq_is_rs(),
            C(
                weight="seq_tis",
                cap=2.0,
                rejection=("seq_sum_k1",),
                rejection_thresholds=((0.5, 2.0),),
            ),
        ),
        (  # verl decoupled_geo_rs
            C.geo_rs(),
            C(weight="none", rejection=("seq_mean_k1",), rejection_thresholds=((0.999, 1.001),)),
        ),
        (  # verl decoupled_geo_rs_token_tis
            C.geo_rs(weight="token_tis"),
            C(
                weight="token_tis",
                rejection=("seq_mean_k1",),
                rejection_thresholds=((0.999, 1.001),),
            ),
        ),
        (  # verl bypass_ppo_clip_geo_rs
            C.geo_rs(mode="bypass"),
            C(
                mode="bypass",
                weight="none",
                rejection=("seq_mean_k1",),
                rejection_thresholds=((0.999, 1.001),),
            ),
        ),
        (  # verl decoupled_k3_rs_seq_tis
            C.k3_rs(weight="seq_tis"),
            C(weight="seq_tis", rejection=("seq_mean_k3",), rejection_thresholds=(0.01,)),
        ),
    ],
)
def test_preset_equals_explicit_config(
    preset: CorrectionConfig, explicit: CorrectionConfig
) -> None:
    assert preset == explicit


def test_every_preset_builds_by_name_with_defaults() -> None:
    for name in PRESETS:
        assert C.from_preset(name) == getattr(C, name)()
    assert C.from_preset("k3_rs", threshold=0.05, mode="bypass") == C.k3_rs(0.05, mode="bypass")


def test_presets_validate_like_the_constructor() -> None:
    with pytest.raises(
        ValueError, match=r"correction preset 'tis' is unknown; allowed: disabled, token_tis"
    ):
        C.from_preset("tis")
    with pytest.raises(ValueError, match=r"cap=0.5 is invalid"):
        C.token_tis(cap=0.5)
    with pytest.raises(ValueError, match=r"weight='token_mis' is invalid.*bypass mode"):
        C.geo_rs(weight="token_mis", mode="bypass")
    with pytest.raises(TypeError):
        C.from_preset("token_tis", band=(0.5, 2.0))  # not an argument of that preset
