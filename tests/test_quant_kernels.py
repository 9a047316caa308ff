"""Triton quantization kernels (flashrl.quant.kernels) against the torch reference, bit for bit.

On CPU the kernels run under the Triton interpreter: the `interpret` fixture sets TRITON_INTERPRET=1
for the test, and `flashrl.quant.kernels` runs an interpreted copy of the kernels on CPU tensors
(Triton reads the variable when ``@triton.jit`` runs, so that copy is loaded with the interpreter
switched on; nothing has to be set before import, and a GPU session runs both kinds of test).

What the interpreter proves: the kernels' algorithm step by step (amax, scale floor, division,
rounding, clamping, fp8 bit assembly, masks and zero padding, strides, in-place writes), executed
with numpy fp32 arithmetic. What it cannot: GPU code generation. numpy divides IEEE-exactly whether
the kernel says `tl.math.div_rn` or ``/``; `test_ptx_uses_ieee_division` covers that on CPU by
compiling the kernels for sm_90 (Triton's bundled ptxas, no GPU needed), and the `gpu` tests compare
the compiled kernels on CUDA with the CPU reference.

GPU session: ``python -m pytest tests/test_quant_kernels.py -m gpu -v`` (TRITON_INTERPRET unset).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

pytest.importorskip(
    "triton", reason="triton is not installed: the Triton kernel tests need it (pip install triton)"
)

from flashrl.quant import QuantLinear, dispatch, kernels, primitives
from flashrl.quant.dispatch import quantize_activation, quantize_weight, scaled_linear
from flashrl.quant.kernels import launch
from flashrl.quant.schemes import get_scheme

CODES = [torch.int8, torch.float8_e4m3fn]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
GRANULARITIES = ["row", "tensor", "block", "group"]
SHAPES = [(1, 1), (5, 13), (17, 200), (130, 257)]
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels under the Triton interpreter for this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def quantize(impl, granularity: str, x: torch.Tensor, code: torch.dtype, **kw):
    """One entry point per granularity, for the reference (`primitives`) or the kernels (`launch`)."""
    if granularity == "row":
        return impl.quantize_per_row(x, code, **kw)
    if granularity == "tensor":
        return impl.quantize_per_tensor(x, code, **kw)
    if granularity == "block":
        return impl.quantize_per_block(x, code, kw.pop("block", (128, 128)), **kw)
    return impl.quantize_per_group(x, code, kw.pop("group", 128), **kw)


def assert_bit_identical(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Codes and scales equal bit for bit (NaN included), with the first mismatch in the message."""
    for what, a, b in (("codes", got[0], want[0]), ("scales", got[1], want[1])):
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        )
        a_bits = a.cpu().contiguous().view(torch.uint8 if a.element_size() == 1 else torch.int32)
        b_bits = b.cpu().contiguous().view(torch.uint8 if b.element_size() == 1 else torch.int32)
        diff = a_bits != b_bits
        if diff.any():
            first = tuple(int(i) for i in diff.nonzero()[0])
            raise AssertionError(
                f"{what}: {int(diff.sum())} of {diff.numel()} differ; first at {first}: "
                f"kernel {a.cpu()[first].item()!r} vs reference {b.cpu()[first].item()!r}"
            )


def stress_data(
    shape: tuple[int, int], gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weights ~ N(0, 0.02) with outliers, plus the cases that stress the rules: an all-zero row (amax
    floor), signed zeros, values in the fp8 subnormal range and below it, and a row's max repeated
    negated."""
    x = torch.randn(shape, generator=gen) * 0.02
    n = x.numel()
    if n > 4:
        idx = torch.randint(0, n, (max(1, n // 300),), generator=gen)
        x.view(-1)[idx] *= 50.0
        tiny = torch.randint(0, n, (max(2, n // 20),), generator=gen)
        x.view(-1)[tiny[::2]] *= 1e-3  # fp8 subnormal codes
        x.view(-1)[tiny[1::2]] *= 1e-7  # rounds to (signed) zero
        x.view(-1)[torch.randint(0, n, (2,), generator=gen)] = -0.0
    if shape[0] > 2:
        x[1] = 0.0
        x[2, 0] = -x[2].abs().max()
    return x.to(dtype)


# ------------------------------------------------------------------------------------------------
# bit-exact against the reference (interpreter)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_matches_reference(granularity, code, dtype, shape, gen, interpret):
    x = stress_data(shape, gen, dtype)
    assert_bit_identical(
        quantize(launch, granularity, x, code), quantize(primitives, granularity, x, code)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_other_input_dtypes(granularity, code, dtype, gen, interpret):
    x = stress_data((9, 150), gen, dtype)
    assert_bit_identical(
        quantize(launch, granularity, x, code), quantize(primitives, granularity, x, code)
    )


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_long_rows_two_passes(granularity, code, gen, interpret):
    """Rows longer than ONE_PASS_MAX_K take the two-pass path (amax over K, then quantize)."""
    x = stress_data((3, 16500), gen, torch.bfloat16)
    assert_bit_identical(
        quantize(launch, granularity, x, code), quantize(primitives, granularity, x, code)
    )


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_strided_input(granularity, code, gen, interpret):
    x = stress_data((140, 24), gen).t()  # [24, 140], column-major
    assert not x.is_contiguous()
    assert_bit_identical(
        quantize(launch, granularity, x, code), quantize(primitives, granularity, x, code)
    )


@pytest.mark.parametrize("code", CODES)
def test_odd_block_and_group_sizes(code, gen, interpret):
    """Block and group sizes that are not powers of two (padded tiles, masked inside the tile)."""
    x = stress_data((50, 170), gen)
    for kw in ({"block": (48, 80)}, {"block": (1, 128)}):
        assert_bit_identical(
            quantize(launch, "block", x, code, **kw), quantize(primitives, "block", x, code, **kw)
        )
    assert_bit_identical(
        quantize(launch, "group", x, code, group=96),
        quantize(primitives, "group", x, code, group=96),
    )


def grid_values(code: torch.dtype) -> torch.Tensor:
    """One row whose amax makes the scale exactly 1, so ``x / s == x``: every code, every rounding
    midpoint between neighbouring codes (ties: half to even), one and two ulps either side of each
    midpoint, signed zeros and fp32 subnormals."""
    qmax = QMAX[code]
    if code == torch.int8:
        codes = torch.arange(-127, 128, dtype=torch.float32)
    else:
        pos = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
        codes = torch.cat([-pos.flip(0), pos])
    mids = (codes[:-1] + codes[1:]) / 2  # exact in fp32
    near = [mids]
    up, down = mids.clone(), mids.clone()
    for _ in range(2):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(-float("inf")))
        near += [up, down]
    special = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0**-10, -(2.0**-10), 2.0**-11, 1.5 * 2.0**-9]
    )
    row = torch.cat([torch.tensor([qmax]), codes, *near, special])
    return row[row.abs() <= qmax][None, :]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_rounding_grid(granularity, code, interpret):
    """Every code and every tie with scale 1: int8 rounds half to even, fp8 rounds to nearest even
    on the e4m3 grid (normals, subnormals, the carry into the next binade, signed zero)."""
    x = grid_values(code)
    got, want = quantize(launch, granularity, x, code), quantize(primitives, granularity, x, code)
    assert want[1].item() == 1.0
    assert_bit_identical(got, want)


@pytest.mark.parametrize("code", CODES)
def test_out_of_range_values_clamp_before_the_cast(code, interpret):
    """With a given scale smaller than amax / qmax (the per-tensor path's second kernel reads the
    scale instead of computing it), values beyond qmax and infinities clamp to +-qmax like the
    reference ``clamp(x / s)`` then cast; fresh scales never get there, so only this test sees it."""
    x = torch.tensor(
        [[0.0, 127.4, 127.5, 128.0, 447.9, 448.5, 464.0, 470.0, 1e30, float("inf"), 3.3]]
    )
    x = torch.cat([x, -x])
    scale = torch.tensor(1.0)
    got = torch.empty(x.shape, dtype=code)
    launch.launch_rows(kernels.kernels_for(x), x, got, scale, 0, False, code, QMAX[code])
    y = torch.clamp(x / scale, -QMAX[code], QMAX[code])
    want = (torch.round(y) if code == torch.int8 else y).to(code)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (got, want)


def division_sensitive(code: torch.dtype, gen: torch.Generator, count: int = 16) -> torch.Tensor:
    """A matrix on which the division rule matters: its amax `a` has ``a * (1/qmax) != a / qmax``
    (the scale), and its other values x have codes of ``x * (1/s)`` != codes of ``x / s``. Every
    row holds `a`, and K < 128, so rows, the tensor, the block and the groups all get scale
    ``s = a / qmax``. A kernel that multiplied by a reciprocal would fail on it."""
    qmax = torch.tensor(QMAX[code])

    def encode(y: torch.Tensor) -> torch.Tensor:
        if code == torch.int8:
            return torch.clamp(torch.round(y), -127, 127).to(torch.int8).view(torch.uint8)
        return torch.clamp(y, -448, 448).to(torch.float8_e4m3fn).view(torch.uint8)

    if code == torch.int8:
        midpoints = torch.arange(0, 127, dtype=torch.float32) + 0.5
    else:
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        midpoints = (grid[:-1] + grid[1:]) / 2
    for _ in range(5000):
        a = torch.rand((), generator=gen) * 0.1 + 0.01
        s = a / qmax
        if a * (1 / qmax) == s:
            continue
        up = down = midpoints * s
        cands = [up]
        for _step in range(4):
            up = torch.nextafter(up, torch.tensor(float("inf")))
            down = torch.nextafter(down, torch.tensor(0.0))
            cands += [up, down]
        x = torch.cat(cands)
        x = x[x <= a]
        x = x[encode(x / s) != encode(x * (1 / s))]
        if x.numel() >= count:
            break
    else:
        raise AssertionError("no division-sensitive inputs found")
    x = x[:count] * torch.where(torch.rand(count, generator=gen) < 0.5, -1.0, 1.0)
    rows = torch.cat([a.expand(4, 1), x.reshape(4, -1)], dim=1)
    rows[1::2, 0] = -a
    return rows


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_division_rule(granularity, code, gen, interpret):
    """``x / s`` and ``amax / qmax``, never a reciprocal multiply (numerics.md rule 4)."""
    x = division_sensitive(code, gen)
    want = quantize(primitives, granularity, x, code)
    s = want[1].reshape(-1)[0]
    amax = x.abs().max()
    assert amax * (1 / torch.tensor(QMAX[code])) != s, "the scale must tell the two rules apart"
    assert codes_differ(quantize_reciprocal(x, s, code), want[0]), (
        "the codes must tell the two rules apart"
    )
    assert_bit_identical(quantize(launch, granularity, x, code), want)


def quantize_reciprocal(x: torch.Tensor, s: torch.Tensor, code: torch.dtype) -> torch.Tensor:
    y = x * (1 / s)
    if code == torch.int8:
        return torch.clamp(torch.round(y), -127, 127).to(torch.int8)
    return torch.clamp(y, -448, 448).to(torch.float8_e4m3fn)


def codes_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.view(torch.uint8) != b.view(torch.uint8)).any())


# ------------------------------------------------------------------------------------------------
# in place, stale scales, QuantLinear and GEMM through the dispatch
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_in_place_outputs(granularity, code, gen, interpret):
    """Codes and scales land in the given buffers (views into larger ones, as QuantLinear's shards
    are), pointers unchanged; a stale, larger scale is overwritten, never max-ed with."""
    x = stress_data((20, 136), gen, torch.bfloat16)
    want = quantize(primitives, granularity, x, code)
    codes_buf = torch.zeros(30, 136, dtype=code)
    scales_buf = torch.full((want[1].numel() + 3,), 1e30, dtype=torch.float32)
    out = codes_buf[5:25]
    scale_out = scales_buf[1 : 1 + want[1].numel()].view(want[1].shape)
    ptrs = (out.data_ptr(), scale_out.data_ptr())
    got = quantize(launch, granularity, x, code, out=out, scale_out=scale_out)
    assert got[0] is out and got[1] is scale_out and (out.data_ptr(), scale_out.data_ptr()) == ptrs
    assert_bit_identical(got, want)
    assert (codes_buf[:5].float() == 0).all() and (codes_buf[25:].float() == 0).all(), (
        "wrote outside out"
    )
    assert scales_buf[0] == 1e30 and (scales_buf[1 + want[1].numel() :] == 1e30).all(), (
        "wrote outside scale_out"
    )


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_quantlinear_requantize_through_kernels(scheme, gen, interpret):
    """`QuantLinear.requantize_` (full weight and one shard) with the kernels forced equals the
    torch reference path buffer for buffer, in place."""
    shards = (136, 8, 16)
    w = [(torch.randn(sum(shards), 200, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(2)]
    with kernels.mode_scope("torch"):
        ref = QuantLinear(200, sum(shards), scheme, shard_sizes=shards)
        ref.requantize_(w[0])
        ref.requantize_(w[1][136:144], shard=1)
    with kernels.mode_scope("triton"):
        layer = QuantLinear(200, sum(shards), scheme, shard_sizes=shards)
        ptrs = {name: b.data_ptr() for name, b in layer.named_buffers()}
        layer.requantize_(w[0])
        changed = layer.requantize_(w[1][136:144], shard=1, count_changed=True)
    assert changed > 0
    assert {name: b.data_ptr() for name, b in layer.named_buffers()} == ptrs
    for (name, a), (_, b) in zip(layer.named_buffers(), ref.named_buffers()):
        assert torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a,
            b.view(torch.uint8) if b.element_size() == 1 else b,
        ), name


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_gemm_activation_quantization_through_kernels(scheme, gen, interpret):
    """The GEMMs quantize activations through `quantize_activation`: identical outputs either way."""
    s = get_scheme(scheme)
    w = (torch.randn(32, 144, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(2, 3, 144, generator=gen).to(torch.bfloat16)
    with kernels.mode_scope("torch"):
        wq, ws = quantize_weight(w, s)
        want = scaled_linear(x, wq, ws, s)
    with kernels.mode_scope("triton"):
        got = scaled_linear(x, wq, ws, s)
        got_act = quantize_activation(x[0], s)
    assert torch.equal(got, want)
    with kernels.mode_scope("torch"):
        assert_bit_identical(got_act, quantize_activation(x[0], s))


# ------------------------------------------------------------------------------------------------
# non-finite inputs
# ------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf / inf
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_non_finite_weights_raise_the_reference_error(scheme, bad, interpret):
    w = torch.randn(20, 150)
    w[3, 7] = bad
    w[11, 140] = bad
    messages = []
    for mode in ("torch", "triton"):
        with (
            kernels.mode_scope(mode),
            pytest.raises(ValueError, match=r"2 non-finite value\(s\).*\(3, 7\)") as err,
        ):
            quantize_weight(w, get_scheme(scheme), name="layer.weight")
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("layer.weight: ")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf / inf
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_non_finite_activations_give_nan_scales_like_the_reference(granularity, code, interpret):
    """Activations are not checked (per forward, no host sync): a NaN reaches its row's, group's or
    tensor's scale as in the reference (Triton's plain max could drop it), and the other rows are
    unaffected. Inf gives an infinite scale."""
    x = torch.randn(6, 140)
    x[1, 3] = float("nan")
    x[4, 130] = float("inf")
    got = quantize(launch, granularity, x, code, check_finite=False)
    want = quantize(primitives, granularity, x, code, check_finite=False)
    assert torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(
        got[1].isinf(), want[1].isinf()
    )
    finite = torch.isfinite(want[1])
    assert torch.equal(got[1][finite], want[1][finite])
    if granularity in ("row", "group"):
        clean = [0, 2, 3, 5]
        assert_bit_identical((got[0][clean], got[1][clean]), (want[0][clean], want[1][clean]))


# ------------------------------------------------------------------------------------------------
# dispatch and switches
# ------------------------------------------------------------------------------------------------


def test_auto_mode_uses_torch_on_cpu_and_logs_once(monkeypatch, caplog):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "_logged", set())
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="flashrl.quant.kernels"):
        assert dispatch.backend(x) == "torch"
        dispatch.backend(x)
    records = [r.getMessage() for r in caplog.records if r.name == "flashrl.quant.kernels"]
    assert records == [f"quantization kernels on cpu: torch reference ({kernels.ENV_VAR}=auto)"]


def test_env_switch(monkeypatch, interpret):
    x = torch.randn(4, 8)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert dispatch.backend(x) == "triton"
    monkeypatch.setenv(kernels.ENV_VAR, " Torch ")
    assert dispatch.backend(x) == "torch"
    with kernels.mode_scope("triton"):  # the in-process override wins over the environment
        assert dispatch.backend(x) == "triton"
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(
        ValueError,
        match="FLASHRL_QUANT_KERNELS='cuda' is not a kernel mode; allowed: auto, triton, torch",
    ):
        kernels.get_mode()
    with pytest.raises(ValueError, match="allowed: auto, triton, torch"):
        kernels.set_mode("fast")


def test_forcing_triton_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.randn(8, 16)
    with kernels.mode_scope("triton"):
        with pytest.raises(
            RuntimeError, match=r"FLASHRL_QUANT_KERNELS=triton .* on cpu: .*TRITON_INTERPRET=1"
        ):
            quantize_weight(w, get_scheme("int8"))
        with pytest.raises(RuntimeError, match="on cpu"):
            quantize_activation(w, get_scheme("fp8_block"))
        monkeypatch.setattr(kernels, "_triton_found", False)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(RuntimeError, match="triton package is not installed"):
            quantize_weight(w, get_scheme("int8"))
    with pytest.raises(RuntimeError, match="cannot run: the triton package is not installed"):
        launch.quantize_per_row(w, torch.int8)


def test_bad_buffers_raise_like_the_reference(interpret):
    x = torch.randn(4, 130)
    with pytest.raises(ValueError, match="expected shape"):
        launch.quantize_per_row(x, torch.int8, out=torch.empty(4, 129, dtype=torch.int8))
    with pytest.raises(ValueError, match="scale_out .* expected shape"):
        launch.quantize_per_block(x, torch.float8_e4m3fn, scale_out=torch.empty(1, 1))
    with pytest.raises(ValueError, match="one element"):
        launch.quantize_per_tensor(x, torch.float8_e4m3fn, scale_out=torch.empty(2))
    with pytest.raises(ValueError, match="unsupported code dtype"):
        launch.quantize_per_group(x, torch.float16)


# ------------------------------------------------------------------------------------------------
# GPU code generation, checked on CPU
# ------------------------------------------------------------------------------------------------


def compile_ptx(fn, pointers: dict[str, str], constexprs: dict[str, object], arch: int = 90) -> str:
    """PTX of `fn` compiled for sm_`arch` by Triton's own toolchain (bundled ptxas); needs no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32")
        for name in fn.arg_names
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", arch, 64 if arch >= 90 else 32)
    return triton.compile(source, target=target, options={"enable_fp_fusion": False}).asm["ptx"]


GROUP_GEMM_PTX_CASES = [  # (pointer types, constexprs, arches) of group_gemm.int8_group_gemm_kernel
    (
        {"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "b_ptr": "*bf16",
         "y_ptr": "*i16"},
        dict(GROUP=64, HAS_BIAS=True, OUT_BF16=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64),
        (90, 80),
    ),
    (
        {"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "b_ptr": "*fp16",
         "y_ptr": "*fp16"},
        dict(GROUP=128, HAS_BIAS=False, OUT_BF16=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128),
        (90, 80),
    ),
]  # fmt: skip


def test_jit_globals_are_named_as_their_def_for_inductor():
    """torch.compile (inductor) rebuilds a user Triton kernel from source: for each name the kernel's
    code loads that is a ``@triton.jit`` global, it pastes that function's source, whose ``def`` line
    gives the name. A global bound to a function of another name (``_MAX_COMBINE =
    tl.standard._elementwise_max``) is then undefined: every CUDA-graph decode step with int8 or fp8
    failed with a NameError on an H100 (torch 2.11). Checked here the way inductor walks the calls."""
    from triton.runtime.jit import JITFunction

    modules = [kernels._load(interpret=False, source=name) for name in kernels.KERNEL_MODULES]
    todo = [v for module in modules for v in vars(module).values() if isinstance(v, JITFunction)]
    seen, wrong = set(), []
    while todo:
        fn = todo.pop()
        for name in fn.fn.__code__.co_names:
            target = fn.fn.__globals__.get(name)
            if isinstance(target, JITFunction) and name not in seen:
                seen.add(name)
                todo.append(target)
                if target.fn.__name__ != name:
                    wrong.append(f"{fn.fn.__name__} calls {name}, defined as {target.fn.__name__}")
    assert {"_max_combine", "_bf16_bits"} <= seen and not wrong, wrong


def test_ptx_uses_ieee_division():
    """Every kernel (the `int8_g*` GEMM too, which divides nowhere) compiles for H100 (sm_90) and
    A100 (sm_80), and every division in it is
    ``div.rn.f32`` (IEEE round to nearest). Triton's plain ``/`` would give ``div.full.f32``
    (approximate) and a reciprocal ``rcp.approx``: neither may appear. The interpreter cannot see
    this difference (numpy divides exactly either way), so this is what catches a ``/`` on CPU."""
    import triton
    from triton.backends import backends

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip(
            f"compiling without a GPU needs triton >= 3.4 (installed: {triton.__version__})"
        )
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    k = kernels._load(interpret=False)
    base = {"QMAX": 448.0, "EPS": 1e-10, "IS_INT8": False}
    rows = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32"}
    cases = [  # (kernel, pointer types, constexprs, divides, arches)
        (
            k.quant_rows_kernel,
            rows,
            dict(base, COMPUTE_SCALE=True, BLOCK_M=1, BLOCK_K=4096, ONE_PASS=True),
            True,
            (90, 80),
        ),
        (
            k.quant_rows_kernel,
            dict(rows, x_ptr="*fp32", q_ptr="*i8"),
            dict(
                base,
                IS_INT8=True,
                QMAX=127.0,
                COMPUTE_SCALE=True,
                BLOCK_M=1,
                BLOCK_K=4096,
                ONE_PASS=False,
            ),
            True,
            (90,),
        ),
        (
            k.quant_rows_kernel,
            rows,
            dict(base, COMPUTE_SCALE=False, BLOCK_M=4, BLOCK_K=1024, ONE_PASS=True),
            True,
            (90,),
        ),
        (
            k.rows_amax_kernel,
            {"x_ptr": "*bf16", "amax_ptr": "*fp32"},
            dict(BLOCK_M=1, BLOCK_K=4096),
            False,
            (90,),
        ),
        (
            k.tensor_scale_kernel,
            {"amax_ptr": "*fp32", "s_ptr": "*fp32"},
            dict(QMAX=448.0, EPS=1e-10, BLOCK=1024),
            True,
            (90,),
        ),
        (
            k.quant_tiles_kernel,
            rows,
            dict(base, ROWS=128, COLS=128, PAD_ROWS=128, PAD_COLS=128, ROW_SCALES=False),
            True,
            (90, 80),
        ),
        (
            k.quant_tiles_kernel,
            rows,
            dict(base, ROWS=32, COLS=128, PAD_ROWS=32, PAD_COLS=128, ROW_SCALES=True),
            True,
            (90,),
        ),
    ]
    gemm_kernel = kernels._load(interpret=False, source="group_gemm").int8_group_gemm_kernel
    cases += [(gemm_kernel, *case[:2], False, case[2]) for case in GROUP_GEMM_PTX_CASES]
    for fn, pointers, constexprs, divides, arches in cases:
        for arch in arches:
            ptx = compile_ptx(fn, pointers, constexprs, arch)
            divisions = set(re.findall(r"\b(?:div|rcp)\.[a-z0-9.]+", ptx))
            assert divisions == ({"div.rn.f32"} if divides else set()), (
                f"{fn.__name__} sm_{arch} {constexprs}: {sorted(divisions)}"
            )


# ------------------------------------------------------------------------------------------------
# GPU (compiled kernels on CUDA)
# ------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def compiled(monkeypatch):
    """CUDA tensors run the compiled kernels only without TRITON_INTERPRET."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


GPU_SHAPES = [(1, 1), (7, 300), (130, 257), (1024, 4096), (64, 20000), (300, 14336)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_gpu_kernels_match_cpu_reference(granularity, code, dtype, gen, compiled):
    cases = [stress_data(shape, gen, dtype) for shape in GPU_SHAPES]
    cases += [grid_values(code), division_sensitive(code, gen, 64)]  # fp32: exact ties, rule 4
    for x in cases:
        want = quantize(primitives, granularity, x, code)
        got = quantize(launch, granularity, x.cuda(), code)
        assert got[0].is_cuda
        assert_bit_identical(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_gpu_torch_path_matches_cpu_reference(granularity, code, gen):
    """The torch reference on CUDA gives the CPU bits too (its scale divides by a device tensor:
    CUDA torch multiplies by the reciprocal when dividing by a Python scalar)."""
    for shape in [(130, 257), (1024, 4096)]:
        x = stress_data(shape, gen, torch.bfloat16)
        assert_bit_identical(
            quantize(primitives, granularity, x.cuda(), code),
            quantize(primitives, granularity, x, code),
        )
    x = division_sensitive(code, gen, 64)
    assert_bit_identical(
        quantize(primitives, granularity, x.cuda(), code),
        quantize(primitives, granularity, x, code),
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_gpu_quantlinear_requantize_uses_kernels(scheme, monkeypatch, gen, compiled):
    """In auto mode a CUDA QuantLinear re-quantizes through the Triton kernels, in place, with the
    CPU reference's bits; its forward quantizes activations through them too."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    calls = []
    for key, original in list(dispatch.QUANTIZERS.items()):
        if key[1] == "triton":
            monkeypatch.setitem(
                dispatch.QUANTIZERS,
                key,
                lambda *a, _f=original, _n=key[0], **kw: calls.append(_n) or _f(*a, **kw),
            )
    shards = (256, 128, 128)
    w = (torch.randn(512, 1024, generator=gen) * 0.02).to(torch.bfloat16)
    layer = QuantLinear(1024, 512, scheme, shard_sizes=shards, device="cuda")
    ptrs = {name: b.data_ptr() for name, b in layer.named_buffers()}
    layer.requantize_(w.cuda())
    assert calls, "requantize_ did not use the Triton kernels"
    assert {name: b.data_ptr() for name, b in layer.named_buffers()} == ptrs
    with kernels.mode_scope("torch"):
        ref = QuantLinear(1024, 512, scheme, shard_sizes=shards)
        ref.requantize_(w)
    for (name, a), (_, b) in zip(layer.named_buffers(), ref.named_buffers()):
        assert torch.equal(
            a.cpu().view(torch.uint8) if a.element_size() == 1 else a.cpu(),
            b.view(torch.uint8) if b.element_size() == 1 else b,
        ), name
    calls.clear()
    layer(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16))
    assert calls, "the forward did not quantize activations with the Triton kernels"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block"])
def test_gpu_activation_quantization_in_a_cuda_graph(scheme, compiled):
    """Activation quantization (no finite check, so no host sync) can be captured and replayed."""
    s = get_scheme(scheme)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    with kernels.mode_scope("triton"):
        quantize_activation(x, s)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q, scale = quantize_activation(x, s)
        x.copy_(torch.randn_like(x) * 3)
        graph.replay()
        torch.cuda.synchronize()
    assert_bit_identical((q, scale), quantize_activation(x.cpu(), s))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_block"])
def test_gpu_non_finite_weights_raise(scheme, compiled):
    w = torch.randn(256, 512)
    w[100, 300] = float("nan")
    with pytest.raises(
        ValueError, match=r"weight: tensor contains 1 non-finite value\(s\).*\(100, 300\)"
    ):
        with kernels.mode_scope("triton"):
            quantize_weight(w.cuda(), get_scheme(scheme))
