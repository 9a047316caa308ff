"""What this CPU can do, from /proc/cpuinfo flags: the few vLLM-CPU features that depend on them.

Tests use these for skip conditions only where vLLM-CPU itself behaves differently by ISA; every
condition names the flag and what vLLM does without it.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
"""What torch.cpu._is_avx512_supported() (the check vLLM-CPU 0.32 makes) requires."""


def has_avx512_or_amx() -> bool:
    """vLLM-CPU 0.32 builds an fp8 KV cache only with AVX-512 or AMX: without them
    `_get_attn_isa` raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"."""
    flags = cpu_flags()
    return AVX512 <= flags or "amx_tile" in flags


def has_int8_dot_product() -> bool:
    """Whether oneDNN's int8 GEMM accumulates u8 x s8 pairs in int32 (VNNI: avx512_vnni, avx_vnni,
    or AMX). Without VNNI it uses vpmaddubsw, whose 16-bit pair sums saturate for weight codes above
    64 in magnitude, so vLLM-CPU's `CPUInt8ScaledMMLinearKernel` is 3-4% (relative) off exact int8
    math and flashrl's kernel probe (`PROBE_TOLERANCE_INT8`) runs its own exact op instead."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


NO_INT8_VNNI = (
    "this CPU has no avx512_vnni/avx_vnni/amx_int8: vLLM-CPU's oneDNN int8 GEMM saturates 16-bit "
    "pair sums (vpmaddubsw) and is 3-4% off exact int8, so flashrl runs its own int8 op"
)
NO_AVX512_AMX = (
    "this CPU has neither AVX-512 (avx512f/bw/vl/dq) nor amx_tile: vLLM-CPU 0.32 refuses its fp8 KV "
    "cache ('FP8 KV cache on CPU requires x86 with AVX-512 or AMX')"
)
