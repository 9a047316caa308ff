"""What the checks of `flashrl verify` share: row statuses, tolerances, the two tiny checkpoints
and the engines built on them, and which schemes a device can run (also used by `flashrl
profile`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashrl.core.config import RolloutConfig
from flashrl.engine import Engine, EngineConfig
from flashrl.quant.schemes import QuantScheme, get_scheme
from flashrl.testing import save_tiny_model

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
GEMM_FP32_TOL = 1e-5
GEMM_BF16_TOL = 1e-2
LOGPROB_TOL = 1e-4
KV_TOL = 1e-4
KV_MAX_TOL_QUANTIZED = 0.25
TOP_P_BOUNDARY = 1e-6
"""A token whose fp64 ascending cumulative probability lies within this of 1 - top_p is on the
top-p boundary: fp32 and fp64 may legitimately disagree on its membership, so it is not compared."""
TEMPERATURE, TOP_P = 0.7, 0.9
TINY_MODEL = dict(
    family="qwen2",
    hidden_size=128,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=256,
    initializer_range=0.1,
)


@dataclass
class CheckResult:
    """One row of the verify table."""

    check: str
    scheme: str
    status: str
    detail: str
    tolerance: str = ""
    seconds: float = 0.0


@dataclass
class VerifyContext:
    """Shared inputs of the checks: the device and two tiny checkpoints (built on first use)."""

    device: torch.device
    root: Path
    checkpoints: dict[str, Path] = field(default_factory=dict)

    def checkpoint(self, name: str) -> Path:
        """Checkpoint "a" (seed 0) or "b" (seed 1): same shapes, unrelated weights."""
        if name not in self.checkpoints:
            overrides = {k: v for k, v in TINY_MODEL.items() if k != "family"}
            self.checkpoints[name] = save_tiny_model(
                self.root / name, TINY_MODEL["family"], seed={"a": 0, "b": 1}[name], **overrides
            )
        return self.checkpoints[name]

    def engine(self, name: str, scheme: str, dtype: str = "bf16") -> Engine:
        engine = EngineConfig(
            dtype=dtype, device=self.device, max_batch=4, max_len=64, seed=0, progress=False
        )
        return Engine(self.checkpoint(name), RolloutConfig(quant=scheme), engine)


class CheckFailed(Exception):
    """Raised inside a check with the row's detail."""


def scheme_unsupported_reason(scheme: str | QuantScheme, device: torch.device | str) -> str | None:
    """Why `scheme` cannot run on `device`, or None when it can."""
    s, device = get_scheme(scheme), torch.device(device)
    if not s.is_quantized or device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"flashrl's quantized GEMMs run on cpu and cuda, not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    fp8_tensor_or_row = s.code_dtype == torch.float8_e4m3fn and s.weight_granularity != "block"
    if fp8_tensor_or_row and (major, minor) < (8, 9):
        return (
            f"fp8 GEMMs (torch._scaled_mm) need compute capability 8.9+ (Ada/Hopper); this "
            f"GPU is {major}.{minor}"
        )
    if s.code_dtype == torch.int8 and (major, minor) < (8, 0):
        return (
            f"int8 GEMMs (torch._int_mm) need compute capability 8.0+; this GPU is {major}.{minor}"
        )
    return None


def fp32_fp8_unsupported(device: torch.device, s: QuantScheme, dtype: torch.dtype) -> bool:
    """fp32 output of a CUDA `torch._scaled_mm` (fp8, tensor or row scales) is refused by some
    GPU / cuBLAS combinations (the CUTLASS path allows bf16 output only): reported, not failed."""
    return (
        device.type == "cuda"
        and dtype == torch.float32
        and s.code_dtype == torch.float8_e4m3fn
        and s.weight_granularity != "block"
    )


def token_ids(seed: int, lengths: Sequence[int], vocab: int = 256) -> list[list[int]]:
    """Seeded random prompts of the given lengths (ids 3 and up: clear of the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
