"""`Engine.update_weights(count_changed=True)`: the fraction of stored rollout weights one update
changed, quantized codes and high-precision values apart (`flashrl.model.weight_changes`)."""

from __future__ import annotations

import pytest
import torch

from flashrl.engine import Engine, EngineConfig
from flashrl.model.weight_changes import ChangeCounts
from flashrl.model.weights import iter_checkpoint
from flashrl.quant.linear import QuantLinear
from flashrl.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen2")


@pytest.fixture(scope="module")
def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(model_dir))


def engine(path, quant: str, dtype: str) -> Engine:
    return Engine(path, quant, EngineConfig(dtype=dtype, device="cpu", progress=False))


def perturbed(
    state: dict[str, torch.Tensor], rel: float, seed: int = 0, bf16: bool = False
) -> dict[str, torch.Tensor]:
    """Every tensor times (1 +- rel), signs random per element; with `bf16`, the tensors are first
    rounded to bf16 (the values a bf16 engine stores)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        base = t.to(torch.bfloat16).float() if bf16 else t.float()
        signs = torch.randint(0, 2, t.shape, generator=gen).float() * 2 - 1
        out[name] = base * (1 + rel * signs)
    return out


def stored(e: Engine) -> dict[str, tuple[bool, torch.Tensor]]:
    """Each stored weight (tied ones once): (quantized, a copy)."""
    out, seen = {}, set()
    for name, module in e.model.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            out[name] = (isinstance(module, QuantLinear), w.detach().clone())
    return out


def counted(state: dict[str, torch.Tensor]) -> int:
    """Elements the counts cover: every sent tensor but biases."""
    return sum(t.numel() for name, t in state.items() if not name.endswith(".bias"))


def test_change_counts_fractions():
    counts = ChangeCounts()
    assert counts.fractions() == {}
    counts.add(False, 1, 4)
    assert counts.fractions() == {"weights_changed_frac": 0.25, "dense_changed_frac": 0.25}
    counts.add(True, 6, 8)
    counts.add(True, 0, 4)
    assert counts.fractions() == {
        "weights_changed_frac": 7 / 16,
        "codes_changed_frac": 0.5,
        "dense_changed_frac": 0.25,
    }


def test_bf16_engine_ignores_changes_below_half_an_ulp(model_dir, checkpoint):
    e = engine(model_dir, "bf16", "bf16")
    before = stored(e)
    small = e.update_weights(perturbed(checkpoint, 1e-5, bf16=True).items(), count_changed=True)
    assert small["dense_changed_frac"] == 0.0 and small["weights_changed_frac"] == 0.0
    assert "codes_changed_frac" not in small  # a bf16 engine has no codes
    after = stored(e)
    assert all(torch.equal(before[k][1], after[k][1]) for k in before)
    large = e.update_weights(perturbed(checkpoint, 1e-1, bf16=True).items(), count_changed=True)
    assert 0.9 < large["dense_changed_frac"] <= 1.0
    assert large["weights_changed_frac"] == large["dense_changed_frac"]


def test_fp32_engine_sees_every_change(model_dir, checkpoint):
    e = engine(model_dir, "bf16", "fp32")
    sent = perturbed(checkpoint, 1e-5)
    out = e.update_weights(sent.items(), count_changed=True)
    nonzero = sum(int(t.count_nonzero()) for name, t in sent.items() if not name.endswith(".bias"))
    assert nonzero < counted(sent)  # the embedding's padding row is zero: 0 * (1 + eps) == 0
    assert out["dense_changed_frac"] == pytest.approx(nonzero / counted(sent), abs=1e-12)
    assert out["dense_changed_frac"] > 0.99


def test_no_count_without_count_changed(model_dir, checkpoint):
    out = engine(model_dir, "bf16", "fp32").update_weights(perturbed(checkpoint, 1e-1).items())
    assert not [k for k in out if k.endswith("_changed_frac")]


def test_int8_fractions_match_the_stored_weights(model_dir, checkpoint):
    e = engine(model_dir, "int8", "bf16")
    same = e.update_weights(checkpoint.items(), count_changed=True)
    assert same["weights_changed_frac"] == same["codes_changed_frac"] == 0.0
    assert same["dense_changed_frac"] == 0.0

    before = stored(e)
    out = e.update_weights(perturbed(checkpoint, 1e-1, seed=1).items(), count_changed=True)
    after = stored(e)
    changed = {True: 0, False: 0}
    total = {True: 0, False: 0}
    for name, (quantized, old) in before.items():
        changed[quantized] += int((old != after[name][1]).sum())
        total[quantized] += old.numel()
    assert total[True] == e.weights.quantized_codes()
    assert total[True] + total[False] == counted(checkpoint)
    codes, dense = out["codes_changed_frac"], out["dense_changed_frac"]
    assert codes == changed[True] / total[True] and 0 < codes < 1
    assert dense == changed[False] / total[False] and 0.9 < dense <= 1
    weighted = (codes * total[True] + dense * total[False]) / (total[True] + total[False])
    assert out["weights_changed_frac"] == pytest.approx(weighted, rel=1e-12)
    assert min(codes, dense) < out["weights_changed_frac"] < max(codes, dense)
