"""`flashrl verify`: a deterministic self-test of the install on the current device.

Each check compares flashrl with an independent reference and has a stated tolerance, on two tiny
random checkpoints with fixed seeds, so a run repeats exactly. docs/profile.md ("flashrl verify")
has the table of checks and tolerances, and why `logprobs` and `kv_cache` are two checks:

- ``gemm`` (quantized schemes): quantizer round trip, int8 accumulator, `QuantLinear` outputs vs
  float64 references (`flashrl.tools.verify_checks`);
- ``update``: `update_weights` in place equals a fresh load, bit for bit;
- ``logprobs``: every sampled token's logprob vs a float64 recomputation from the logits the
  engine sampled from (observed with `Engine.add_sample_observer`);
- ``kv_cache``: the cached decode path vs the engine's own no-cache forward;
- ``vllm``: `WeightUpdater.update_weights` into vLLM equals a fresh vLLM engine (`flashrl.tools.verify_vllm`).

A scheme that cannot run on the device is a SKIP row with the reason; a SKIP is not a PASS. Any
exception inside a check is a FAIL row naming it. The checks are registered in `CHECKS` (name ->
`Check`), looked up when `run_verify` runs; the GEMM check calls the production kernels through
`flashrl.quant.gemm` and the table `flashrl.quant.dispatch.GEMMS`, so a test can replace either to
make a row fail.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flashrl.core.device import resolve_device
from flashrl.quant.schemes import SCHEMES, get_scheme
from flashrl.tools.verify_checks import check_gemm, check_kv_cache, check_logprobs, check_update
from flashrl.tools.verify_context import (
    FAIL,
    GEMM_BF16_TOL,
    GEMM_FP32_TOL,
    KV_MAX_TOL_QUANTIZED,
    KV_TOL,
    LOGPROB_TOL,
    PASS,
    SKIP,
    CheckFailed,
    CheckResult,
    VerifyContext,
    scheme_unsupported_reason,
)
from flashrl.tools.verify_vllm import check_vllm
from flashrl.utils import device_name, format_table

CheckFn = Callable[[VerifyContext, str], "str | tuple[str, str]"]


@dataclass(frozen=True)
class Check:
    """A registered check: its function, which schemes it runs for (``quantized``, ``all`` or
    ``one`` row) and the tolerance shown in its rows."""

    fn: CheckFn
    schemes: str
    tolerance: str


CHECKS: dict[str, Check] = {
    "gemm": Check(
        check_gemm,
        "quantized",
        f"int8 acc exact; fp32 rel <= {GEMM_FP32_TOL:g}; bf16 rel <= {GEMM_BF16_TOL:g}",
    ),
    "update": Check(check_update, "all", "bit-exact"),
    "logprobs": Check(check_logprobs, "all", f"max <= {LOGPROB_TOL:g} nats"),
    "kv_cache": Check(
        check_kv_cache,
        "all",
        f"bf16: max <= {KV_TOL:g}; quantized: median <= "
        f"{KV_TOL:g}, max <= {KV_MAX_TOL_QUANTIZED:g} nats",
    ),
    "vllm": Check(check_vllm, "one", "equal"),
}
"""The checks in the order they run (tests may replace an entry to make its rows fail)."""


@dataclass
class VerifyConfig:
    """The flags of `flashrl verify`."""

    device: str | None = None
    """cpu, cuda or cuda:N (default: cuda when available)."""
    quant: str | None = None
    """Comma-separated schemes to check (default: all)."""
    no_vllm: bool = False
    """Skip the vLLM backend check even if vLLM is installed."""
    out: str | None = None
    """Also write the results as JSON to this file."""


def _run_one(name: str, check: Check, ctx: VerifyContext, scheme: str) -> CheckResult:
    start = time.perf_counter()
    reason = scheme_unsupported_reason(scheme, ctx.device)
    if reason is not None:
        return CheckResult(name, scheme, SKIP, reason, check.tolerance)
    try:
        out = check.fn(ctx, scheme)
        status, detail = out if isinstance(out, tuple) else (PASS, out)
    except CheckFailed as err:
        status, detail = FAIL, str(err)
    except Exception as err:
        status, detail = FAIL, f"{type(err).__name__}: {err}"
    return CheckResult(name, scheme, status, detail, check.tolerance, time.perf_counter() - start)


def _rows(
    name: str, check: Check, ctx: VerifyContext, names: list[str], vllm: bool
) -> list[CheckResult]:
    quantized = [s for s in names if get_scheme(s).is_quantized]
    if check.schemes != "one":
        return [
            _run_one(name, check, ctx, s)
            for s in (quantized if check.schemes == "quantized" else names)
        ]
    runnable = (
        s
        for s in ("int8", *quantized)
        if s in names and scheme_unsupported_reason(s, ctx.device) is None
    )
    scheme = next(runnable, names[0])
    if not vllm:
        return [CheckResult(name, scheme, SKIP, "disabled (--no-vllm)", check.tolerance)]
    return [_run_one(name, check, ctx, scheme)]


def run_verify(
    device: str | torch.device | None = None,
    schemes: Sequence[str] | None = None,
    vllm: bool = True,
    progress: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run every check for every scheme (default: all) on `device` (default: cuda if available,
    else cpu); returns one `CheckResult` per row. `vllm=False` reports the vLLM row as SKIP."""
    device = resolve_device(device)
    names = [get_scheme(s).name for s in (schemes or SCHEMES)]
    results: list[CheckResult] = []
    with (
        tempfile.TemporaryDirectory(prefix="flashrl-verify-") as tmp,
        torch.random.fork_rng(devices=[]),
    ):
        torch.manual_seed(0)
        ctx = VerifyContext(device=device, root=Path(tmp))
        for name, check in CHECKS.items():
            for row in _rows(name, check, ctx, names, vllm):
                results.append(row)
                if progress is not None:
                    progress(row)
    return results


def format_results(
    results: Sequence[CheckResult], device: torch.device | str, seconds: float
) -> str:
    """The PASS/FAIL table and a one-line summary."""
    rows = [
        {
            "check": r.check,
            "scheme": r.scheme,
            "status": r.status,
            "detail": r.detail,
            "tolerance": r.tolerance,
            "s": f"{r.seconds:.2f}",
        }
        for r in results
    ]
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    failed = [f"{r.check}[{r.scheme}]" for r in results if r.status == FAIL]
    summary = (
        f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped on "
        f"{device_name(device)} in {seconds:.1f} s"
    )
    if failed:
        summary += f"; FAILED: {', '.join(failed)}"
    columns = ["check", "scheme", "status", "detail", "tolerance", "s"]
    return format_table(rows, columns) + "\n" + summary


def results_json(
    results: Sequence[CheckResult], device: torch.device | str, seconds: float
) -> dict[str, Any]:
    """The JSON document `flashrl verify --out` writes."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "seconds": seconds,
        "passed": not any(r.status == FAIL for r in results),
        "results": [asdict(r) for r in results],
    }


def exit_code(results: Sequence[CheckResult]) -> int:
    """1 when any row failed, else 0 (SKIP rows do not fail the run)."""
    return 1 if any(r.status == FAIL for r in results) else 0
