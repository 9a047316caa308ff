"""`flashrl verify`: passes on CPU, is deterministic, and fails (exit 1, the row named) when a GEMM,
the in-place reload, the sampler's logprobs or a whole check is broken on purpose."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import flashrl.tools.verify as verify
from flashrl.quant.schemes import SCHEMES
from flashrl.tools.cli import main
from flashrl.tools.verify import FAIL, PASS, SKIP, exit_code, run_verify, scheme_unsupported_reason
from flashrl.tools.verify_checks import processed_logprobs_fp64
from flashrl.tools.verify_context import CheckResult, VerifyContext
from flashrl.tools.verify_vllm import check_vllm

CHECK_NAMES = ["gemm", "update", "logprobs", "kv_cache", "vllm"]


def rows(results) -> dict[tuple[str, str], CheckResult]:
    return {(r.check, r.scheme): r for r in results}


def test_verify_passes_on_cpu(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["verify", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["passed"] is True and doc["device"] == "cpu"
    results = {(r["check"], r["scheme"]): r for r in doc["results"]}
    schemes = list(SCHEMES)
    expected = {("gemm", s) for s in schemes[1:]} | {
        (c, s) for c in ("update", "logprobs", "kv_cache") for s in schemes
    }
    assert expected <= set(results)
    assert [r["check"] for r in doc["results"]][-1] == "vllm" and len(results) == len(expected) + 1
    for key in expected - {("kv_cache", "fp8")}:
        assert results[key]["status"] == PASS, results[key]
    # per-tensor fp8 activations are batch-dependent: an explicit SKIP with the reason, not a pass
    assert results[("kv_cache", "fp8")]["status"] == SKIP
    assert "per-tensor activation scales" in results[("kv_cache", "fp8")]["detail"]
    assert "bit-exact" in results[("gemm", "int8")]["detail"]
    vllm_row = results[("vllm", "int8")]
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert vllm_row["status"] == SKIP and "vLLM is not installed" in vllm_row["detail"]
    assert "| SKIP " in printed and "| PASS " in printed and "0 failed" in printed


def test_verify_is_deterministic():
    first = run_verify(device="cpu", schemes=["int8"], vllm=False)
    second = run_verify(device="cpu", schemes=["int8"], vllm=False)
    assert [(r.check, r.status, r.detail) for r in first] == [
        (r.check, r.status, r.detail) for r in second
    ]
    assert [r.check for r in first] == CHECK_NAMES
    assert rows(first)[("vllm", "int8")].detail == "disabled (--no-vllm)"


def test_broken_gemm_fails_its_row(monkeypatch, capsys):
    """An int8 kernel that is off by one in a single accumulator entry: exit 1, `gemm` for int8 named."""
    import flashrl.quant.gemm as gemm

    original = gemm.int8_mm_cpu

    def off_by_one(xq, wq, mirror=None):
        acc = original(xq, wq, mirror)
        acc[0, 0] += 1
        return acc

    monkeypatch.setattr(gemm, "int8_mm_cpu", off_by_one)
    assert main(["verify", "--device", "cpu", "--quant", "int8", "--no-vllm"]) == 1
    printed = capsys.readouterr().out
    fail_rows = [line for line in printed.splitlines() if "| FAIL " in line]
    assert len(fail_rows) == 1 and fail_rows[0].startswith("| gemm ") and "| int8 " in fail_rows[0]
    assert "int8 accumulator differs from integer math" in fail_rows[0]
    assert "1 failed" in printed and "FAILED: gemm[int8]" in printed


def test_broken_fp8_gemm_fails_against_the_float64_reference(monkeypatch):
    from flashrl.quant import dispatch

    original = dispatch.GEMMS["fp8_rowwise", "cpu"]

    def broken(*args, **kwargs):
        return original(*args, **kwargs) * 1.001

    monkeypatch.setitem(dispatch.GEMMS, ("fp8_rowwise", "cpu"), broken)
    results = rows(run_verify(device="cpu", schemes=["fp8_channel"], vllm=False))
    assert results[("gemm", "fp8_channel")].status == FAIL
    assert "fp32 out rel err" in results[("gemm", "fp8_channel")].detail


def test_reload_that_replaces_storage_fails(monkeypatch):
    """Re-quantization that allocates new buffers instead of writing in place (captured CUDA graphs
    would keep reading the old ones) fails the reload row, although the values are right."""
    from flashrl.quant.linear import QuantLinear

    original = QuantLinear.requantize_

    def replacing(self, weight, *args, **kwargs):
        changed = original(self, weight, *args, **kwargs)
        self.weight = self.weight.clone()
        return changed

    monkeypatch.setattr(QuantLinear, "requantize_", replacing)
    results = run_verify(device="cpu", schemes=["bf16", "int8"], vllm=False)
    by_key = rows(results)
    assert by_key[("update", "int8")].status == FAIL
    assert "storage replaced instead of updated in place" in by_key[("update", "int8")].detail
    assert by_key[("update", "bf16")].status == PASS
    assert exit_code(results) == 1


def test_wrong_logprobs_fail(monkeypatch):
    """A sampler whose returned logprobs are off by 1e-3 nats fails the logprobs row."""
    import flashrl.engine.sampler as engine_module

    original = engine_module.sample

    def biased(logits, params, uniforms=None):
        out = original(logits, params, uniforms)
        out.logprobs = out.logprobs + 1e-3
        return out

    monkeypatch.setattr(engine_module, "sample", biased)
    by_key = rows(run_verify(device="cpu", schemes=["int8"], vllm=False))
    assert (
        by_key[("logprobs", "int8")].status == FAIL
        and "max |diff| 0.001" in by_key[("logprobs", "int8")].detail
    )
    assert by_key[("gemm", "int8")].status == PASS


def test_a_crashing_check_is_a_fail_row_and_the_others_still_run(monkeypatch):
    def boom(ctx, scheme):
        raise RuntimeError("boom")

    monkeypatch.setitem(
        verify.CHECKS, "kv_cache", dataclasses.replace(verify.CHECKS["kv_cache"], fn=boom)
    )
    results = run_verify(device="cpu", schemes=["bf16"], vllm=False)
    by_key = rows(results)
    assert (
        by_key[("kv_cache", "bf16")].status == FAIL
        and by_key[("kv_cache", "bf16")].detail == "RuntimeError: boom"
    )
    assert by_key[("update", "bf16")].status == PASS and by_key[("logprobs", "bf16")].status == PASS
    assert exit_code(results) == 1


def test_unsupported_schemes_are_skipped_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(
        verify,
        "scheme_unsupported_reason",
        lambda scheme, device: "needs SM89+ (test)" if str(scheme).startswith("fp8") else None,
    )
    assert main(["verify", "--device", "cpu", "--quant", "int8,fp8", "--no-vllm"]) == 0
    printed = capsys.readouterr().out
    fp8_rows = [line for line in printed.splitlines() if "| fp8 " in line]
    assert len(fp8_rows) == 4 and all(
        "| SKIP " in line and "needs SM89+ (test)" in line for line in fp8_rows
    )
    assert "0 failed" in printed


def test_scheme_unsupported_reason(monkeypatch):
    assert all(
        scheme_unsupported_reason(s, "cpu") is None
        for s in ("bf16", "int8", "fp8", "fp8_channel", "fp8_block")
    )
    assert "not mps" in scheme_unsupported_reason("int8", "mps")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "8.9+" in scheme_unsupported_reason(
        "fp8", "cuda"
    ) and "this GPU is 8.0" in scheme_unsupported_reason("fp8_channel", "cuda")
    assert (
        scheme_unsupported_reason("fp8_block", "cuda") is None
        and scheme_unsupported_reason("int8", "cuda") is None
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "8.0+" in scheme_unsupported_reason("int8", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert scheme_unsupported_reason("fp8", "cuda") is None


def test_vllm_row_skips_when_vllm_is_missing(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object()
    )
    ctx = VerifyContext(torch.device("cpu"), tmp_path)
    status, detail = check_vllm(ctx, "int8")
    assert status == SKIP and detail.startswith("vLLM is not installed")


def test_reference_logprobs_agree_with_the_samplers_replay(gen):
    """The verify reference (float64, full sort) and the engine's replay (fp32, candidate top-p)
    are independent implementations of the same rule: they agree to fp32 precision."""
    from flashrl.core.sampling import replay_processed_logprobs

    logits = torch.randn(64, 300, generator=gen) * 3
    tokens = torch.multinomial((logits / 0.7).softmax(-1), 1, generator=gen)[
        :, 0
    ]  # mostly inside the nucleus
    tokens[:8] = logits[:8].argmin(-1)  # and some outside it
    ref, edge = processed_logprobs_fp64(logits, 0.7, 0.9)
    mine = replay_processed_logprobs(logits, tokens, 0.7, top_p=0.9).double()
    theirs = ref.gather(-1, tokens[:, None])[:, 0]
    keep = ~edge.gather(-1, tokens[:, None])[:, 0]
    assert torch.equal(torch.isinf(mine[keep]), torch.isinf(theirs[keep]))
    finite = keep & torch.isfinite(theirs)
    assert (
        finite.sum() > 40
        and torch.isinf(theirs[:8]).all()
        and (mine[finite] - theirs[finite]).abs().max() < 1e-5
    )


@pytest.mark.vllm
def test_vllm_row_passes_when_vllm_is_installed():
    pytest.importorskip("vllm")
    results = rows(run_verify(device="cpu", schemes=["int8"]))
    assert results[("vllm", "int8")].status == PASS, results[("vllm", "int8")].detail
