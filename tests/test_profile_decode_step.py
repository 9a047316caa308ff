"""benchmarks/profile_decode_step.py's kernel sum, on events made by hand in the shapes the H100 run
returned: a CPU op's self device time repeats its kernels' time and a graph replay's annotation spans
the kernels it launched, so counting either (as the first GPU run did) inflated the step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmark_scripts import load_benchmark

prof = load_benchmark("profile_decode_step")

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


@dataclass
class Event:
    key: str
    device_type: torch.autograd.DeviceType
    self_device_time_total: float = 0.0
    self_cpu_time_total: float = 0.0


EVENTS = [
    Event("## Call CompiledFxGraph abc ##", CUDA, self_device_time_total=5674.0),
    Event("cutlass_80_tensorop_i16832gemm_s8_64x64", CUDA, self_device_time_total=1845.0),
    Event("quant_rows_kernel", CUDA, self_device_time_total=657.0),
    Event("aten::cumsum", CPU, self_device_time_total=246.0, self_cpu_time_total=30.0),
    Event("tensor_kernel_scan_innermost_dim", CUDA, self_device_time_total=246.0),
    Event("cuLaunchKernelEx", CUDA, self_device_time_total=119.0),
    Event("Command Buffer Full", CUDA, self_device_time_total=76.0),
]


def test_cuda_sum_counts_each_kernel_once_and_no_annotation():
    times = prof.kernel_times_us(EVENTS, "cuda")
    assert times == {
        "cutlass_80_tensorop_i16832gemm_s8_64x64": 1845.0,
        "quant_rows_kernel": 657.0,
        "tensor_kernel_scan_innermost_dim": 246.0,
    }
    assert prof.category("quant_rows_kernel") == "quantize"
    assert prof.category("cutlass_80_tensorop_i16832gemm_s8_64x64") == "gemm"


def test_cpu_sum_uses_op_self_times():
    assert prof.kernel_times_us(EVENTS, "cpu") == {"aten::cumsum": 30.0}
