"""`flashrl verify`: a deterministic self-test of the install on the current device.

Accuracy on a benchmark cannot tell a working install from a broken one (FlashRL's install test
separated 0.36 from 0.34 GSM8K accuracy). These checks can: each compares flashrl with an
independent reference and has a stated tolerance. Everything runs on two tiny random checkpoints
(Qwen2 layout with q/k/v biases, hidden 128, 2 layers, unrelated weights A and B) built in a
temporary directory with `flashrl.testing.save_tiny_model`; seeds are fixed, so a run repeats
exactly. About 5 s on one CPU thread.

| check      | schemes   | what                                                                     | tolerance |
|------------|-----------|--------------------------------------------------------------------------|-----------|
| `gemm`     | quantized | quantizer: codes are round-to-nearest of W / s; int8: the `torch._int_mm` accumulator vs int64 integer math (M = 5 and 40: the CUDA row padding too); every scheme: `QuantLinear` forward with fp32 and bf16 activations vs a float64 dequantize-then-matmul of the same codes and scales | `|W - deq| <= s/2` (int8), `<= 2^-4 |W| + 2^-9 s` (fp8), + 1e-4 s for the fp32 division; accumulator bit-exact; `max|y - ref| / max|ref|` <= 1e-5 (fp32 out), <= 1e-2 (bf16 out) |
| `reload`   | all       | engine on A, `update_weights` with B's tensors (q, k, v, gate, up each in its own call, then the rest) vs a fresh engine on B | logits and every parameter and buffer bit-equal; no storage pointer changed |
| `logprobs` | all       | every token sampled at T=0.7, top-p 0.9 (stop tokens and 4 slots for 8 requests, so continuous batching runs): the returned logprob vs a float64 recomputation (temperature, full-sort top-p, log-softmax) from the fp32 logits the engine sampled from; the token lies in the recomputed support | max abs diff <= 1e-4 nats |
| `kv_cache` | all       | the logits the engine sampled from (prefill + KV-cache decode, batched) vs its own no-cache forward over each full sequence, fp32 activations, as temperature-scaled logprobs of the sampled tokens | bf16: max <= 1e-4 nats; quantized: median <= 1e-4 and max <= 0.25 nats |
| `vllm`     | one row   | vLLM backend (if installed): engine on A, `WeightSync.push(B)`, greedy tokens and logprobs vs a fresh vLLM engine on B | equal |

Why `logprobs` and `kv_cache` are two checks: a single comparison of sampled logprobs with a
recomputation from a no-cache forward cannot be tight. A top-p support change of a token near the
cutoff (caused by 1e-6 of fp32 noise) moves the normalizer by that token's probability, and with
quantized activations the per-token scales of a decode batch and of a full-sequence forward see
slightly different inputs, so now and then an activation code flips (measured: up to 0.05 nats on
a few tokens of this sharp tiny model; median 1e-6). `logprobs` therefore checks the sampler
exactly on the logits it was given, and `kv_cache` checks the cached path against the full
forward without truncation, exactly for unquantized activations and by median for quantized ones
(a KV-cache, position or batching bug moves most tokens by 0.1 nats or more). For `fp8`
(per-tensor activation scales span every token of a forward) a full-sequence forward cannot
reproduce a decode batch at all: its `kv_cache` row is a SKIP with that reason; its logprobs are
exact for the batch that sampled, which `logprobs` checks.

A scheme that cannot run on the device (fp8 GEMMs need SM89+ on CUDA) is a SKIP row with the
reason; a SKIP is not a PASS. Any exception inside a check is a FAIL row naming it.

`run_verify` looks the check functions up by name when it runs (``check_<name>``), and the GEMM
check calls the production kernels through `flashrl.quant.gemm`, so a test can monkeypatch either
to make a row fail.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashrl.config import RolloutConfig
from flashrl.quant.schemes import SCHEMES, QuantScheme, get_scheme
from flashrl.utils import device_name, format_table

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
TINY_MODEL = dict(family="qwen2", hidden_size=128, intermediate_size=384, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=256, initializer_range=0.1)


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
    _checkpoints: dict[str, Path] = field(default_factory=dict)

    def checkpoint(self, name: str) -> Path:
        """Checkpoint "a" (seed 0) or "b" (seed 1): same shapes, unrelated weights."""
        if name not in self._checkpoints:
            from flashrl.testing import save_tiny_model

            overrides = {k: v for k, v in TINY_MODEL.items() if k != "family"}
            self._checkpoints[name] = save_tiny_model(self.root / name, TINY_MODEL["family"], seed={"a": 0, "b": 1}[name],
                                                      **overrides)
        return self._checkpoints[name]

    def engine(self, name: str, scheme: str, dtype: str = "bf16"):
        from flashrl.engine.engine import Engine

        return Engine(self.checkpoint(name), quant=RolloutConfig(quant=scheme), dtype=dtype, device=self.device,
                      max_batch=4, max_len=64, seed=0, progress=False)


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
    if s.code_dtype == torch.float8_e4m3fn and s.weight_granularity != "block" and (major, minor) < (8, 9):
        return f"fp8 GEMMs (torch._scaled_mm) need compute capability 8.9+ (Ada/Hopper); this GPU is {major}.{minor}"
    if s.code_dtype == torch.int8 and (major, minor) < (8, 0):
        return f"int8 GEMMs (torch._int_mm) need compute capability 8.0+; this GPU is {major}.{minor}"
    return None


def _fp32_fp8_unsupported(device: torch.device, s: QuantScheme, dtype: torch.dtype) -> bool:
    """fp32 output of a CUDA `torch._scaled_mm` (fp8, tensor or row scales) is refused by some
    GPU / cuBLAS combinations (the CUTLASS path allows bf16 output only): reported, not failed."""
    return (device.type == "cuda" and dtype == torch.float32 and s.code_dtype == torch.float8_e4m3fn
            and s.weight_granularity != "block")


# ------------------------------------------------------------------------------------------------
# (c) GEMM kernels vs references
# ------------------------------------------------------------------------------------------------


def _gemm_inputs(device: torch.device, m: int, k: int = 256, n: int = 192, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 20.0  # an activation outlier channel
    w = torch.randn(n, k, generator=gen) * 0.05
    w[5, 7] = 1.0  # a weight outlier
    b = torch.randn(n, generator=gen) * 0.1
    return x.to(device), w.to(device, torch.bfloat16), b.to(device, torch.bfloat16)


def check_gemm(ctx: VerifyContext, scheme: str) -> str:
    """Quantizer round-trip, the int8 accumulator, and `QuantLinear` outputs vs float64 references."""
    from flashrl.quant import gemm, primitives
    from flashrl.quant.linear import QuantLinear

    s = get_scheme(scheme)
    worst_fp32 = worst_bf16 = 0.0
    fp32_note = ""
    for m in (5, 40):  # 5 < 17 exercises the CUDA row padding of _int_mm
        x, w, b = _gemm_inputs(ctx.device, m, seed=m)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=True, dtype=torch.bfloat16, device=ctx.device)
        with torch.no_grad():
            linear.weight.copy_(w)
            linear.bias.copy_(b)
        layer = QuantLinear.from_linear(linear, s)
        w_deq = layer.dequantized_weight(torch.float64)
        # quantizer: codes are round-to-nearest of W / s
        w64, scale = w.double(), _expand_weight_scale(layer, w.shape)
        err = (w64 - w_deq).abs()
        bound = scale / 2 if s.code_dtype == torch.int8 else w64.abs() * 2.0**-4 + scale * 2.0**-9
        bound = bound + scale * 1e-4  # x / s is an fp32 division: its rounding is ~1e-5 code units
        if bool((err > bound).any()):
            raise CheckFailed(f"quantizer: |W - deq(Q(W))| exceeds the round-to-nearest bound by "
                              f"{float((err - bound).max()):.3g} (M={m})")
        for x_in in (x.float(), x.to(torch.bfloat16)):  # fp32 and bf16 activations (and outputs)
            xq, x_scale = primitives.quantize_activation(x_in, s)
            if s.code_dtype == torch.int8:
                acc = gemm.int8_mm(xq, layer.weight)
                exact = xq.cpu().to(torch.int64) @ layer.weight.cpu().to(torch.int64).t()
                if acc.dtype != torch.int32 or not torch.equal(acc.cpu().to(torch.int64), exact):
                    diff = (acc.cpu().to(torch.int64) - exact).abs().max()
                    raise CheckFailed(f"int8 accumulator differs from integer math (max |diff| {int(diff)}, M={m})")
            ref = _dequantize_activation(xq, x_scale, s) @ w_deq.t() + b.double()
            try:
                y = layer(x_in)
            except RuntimeError as err:
                if not _fp32_fp8_unsupported(ctx.device, s, x_in.dtype):
                    raise
                fp32_note = f"fp32 out not supported by this GPU's fp8 kernel ({str(err).splitlines()[0][:80]})"
                continue
            err = float((y.double() - ref).abs().max()) / float(ref.abs().max())
            if x_in.dtype == torch.float32:
                worst_fp32 = max(worst_fp32, err)
            else:
                worst_bf16 = max(worst_bf16, err)
    detail = fp32_note or f"fp32 out rel err {worst_fp32:.2g}"
    detail += f", bf16 out {worst_bf16:.2g}"
    if s.code_dtype == torch.int8:
        detail = "int32 accumulator bit-exact; " + detail
    if not (worst_fp32 <= GEMM_FP32_TOL and worst_bf16 <= GEMM_BF16_TOL):
        raise CheckFailed(detail)
    return detail


def _expand_weight_scale(layer, shape: tuple[int, int]) -> torch.Tensor:
    """The weight scale of every element [N, K] in float64."""
    s = layer.scheme
    if s.weight_granularity == "block":
        bn, bk = s.block_size
        return layer.weight_scale.double().repeat_interleave(bn, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]
    scale = layer.row_scale[:, None] if layer.row_scale is not None else layer.weight_scale
    return scale.double().reshape(-1, 1).expand(shape) if scale.numel() > 1 else scale.double().reshape(1, 1).expand(shape)


def _dequantize_activation(xq: torch.Tensor, x_scale: torch.Tensor, s: QuantScheme) -> torch.Tensor:
    if s.activation_granularity == "group":
        return xq.double() * x_scale.double().repeat_interleave(s.group_size, 1)[:, : xq.shape[1]]
    return xq.double() * x_scale.double().reshape(-1, 1) if x_scale.numel() > 1 else xq.double() * x_scale.double()


# ------------------------------------------------------------------------------------------------
# (a) reload exactness
# ------------------------------------------------------------------------------------------------


def _token_ids(seed: int, lengths: Sequence[int], vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _update_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """q, k, v, gate and up tensors each in their own call (partial fused updates), then the rest."""
    parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    groups = [[(n, t) for n, t in tensors.items() if f".{p}." in n] for p in parts]
    rest = [(n, t) for n, t in tensors.items() if not any(f".{p}." in n for p in parts)]
    return [g for g in groups if g] + [rest]


def check_reload(ctx: VerifyContext, scheme: str) -> str:
    """update_weights(B) into an engine loaded from A equals a fresh load of B, bit for bit, in place."""
    from flashrl.model.weights import iter_checkpoint

    engine = ctx.engine("a", scheme)
    ids = _token_ids(11, [24])[0]
    before = engine.logits(ids)
    pointers = {n: t.data_ptr() for n, t in _tensors(engine.model).items()}
    groups = _update_groups(dict(iter_checkpoint(ctx.checkpoint("b"))))
    for group in groups:
        engine.update_weights(group)
    fresh = ctx.engine("b", scheme)
    after, expected = engine.logits(ids), fresh.logits(ids)
    if torch.equal(before, expected):
        raise CheckFailed("checkpoints A and B give the same logits: the check would prove nothing")
    if not torch.equal(after, expected):
        raise CheckFailed(f"logits after update differ from a fresh load (max |diff| {float((after - expected).abs().max()):.3g})")
    mine, theirs = _tensors(engine.model), _tensors(fresh.model)
    for name, tensor in mine.items():
        other = theirs[name]
        if tensor.dtype != other.dtype or not torch.equal(tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor,
                                                          other.view(torch.uint8) if other.element_size() == 1 else other):
            raise CheckFailed(f"{name} differs from a fresh load")
    moved = [n for n, t in mine.items() if t.data_ptr() != pointers[n]]
    if moved:
        raise CheckFailed(f"storage replaced instead of updated in place: {', '.join(moved[:3])}")
    return f"{len(groups)} update calls; logits and {len(mine)} tensors bit-equal to a fresh load; storage in place"


# ------------------------------------------------------------------------------------------------
# (b) logprob exactness
# ------------------------------------------------------------------------------------------------


def processed_logprobs_fp64(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-probabilities [T, V] of the processed distribution (temperature, then top-p with
    vLLM's rule: drop tokens whose ascending cumulative probability is <= 1 - top_p, keep the top
    token), written independently of the sampler; and a mask of tokens on the top-p boundary."""
    z = logits.double() / temperature
    probs, order = z.softmax(-1).sort(-1)  # ascending
    cum = probs.cumsum(-1)
    drop = cum <= 1 - top_p
    drop[..., -1] = False
    boundary = (cum - (1 - top_p)).abs() <= TOP_P_BOUNDARY
    unsort = lambda t: torch.zeros_like(t).scatter(-1, order, t)  # noqa: E731
    lp = torch.log_softmax(z.masked_fill(unsort(drop), float("-inf")), -1)
    return lp, unsort(boundary)


@dataclass
class _Sampled:
    """One sampled token as the engine produced it: its request, step, the fp32 logits row the
    sampler received, the token and the logprob it returned."""

    prompt_index: int
    sample_index: int
    step: int
    logits: torch.Tensor
    token: int
    logprob: float


def _generate_recording(engine, prompts: list[list[int]]) -> tuple[list[Any], list[_Sampled]]:
    """`engine.generate` with every sampling step recorded (wraps the engine's `_record` on this
    instance only)."""
    original = getattr(engine, "_record", None)
    if original is None:
        raise CheckFailed("this engine has no _record step to observe; flashrl.verify needs updating")
    sampled: list[_Sampled] = []

    def recording(requests, logits, params) -> None:
        original(requests, logits, params)
        for k, r in enumerate(requests):
            sampled.append(_Sampled(r.prompt_index, r.sample_index, len(r.response) - 1,
                                    logits[k].detach().float().cpu().clone(), int(r.response[-1]), float(r.logprobs[-1])))

    engine._record = recording
    try:
        rollouts = engine.generate(prompts, _sampling_params())
    finally:
        del engine._record
    return rollouts, sampled


def _sampling_params():
    from flashrl.engine.sampler import SamplingParams

    # Stop tokens end sequences at different steps and max_batch=4 < 8 requests: slots are freed,
    # compacted and refilled mid-decode, so continuous batching is part of what is checked.
    return SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=16, n=2, seed=1234, ignore_eos=True,
                          stop_token_ids=tuple(range(3, 23)))


def _prompts() -> list[list[int]]:
    return _token_ids(5, [3, 7, 12, 20])


def check_logprobs(ctx: VerifyContext, scheme: str) -> str:
    """Every sampled token's returned logprob (T=0.7, top-p 0.9) vs a float64 recomputation of the
    processed distribution from the fp32 logits the engine sampled from."""
    engine = ctx.engine("a", scheme)
    rollouts, sampled = _generate_recording(engine, _prompts())
    returned = {(r.prompt_index, r.sample_index, t): lp for r in rollouts for t, lp in enumerate(r.logprobs)}
    if len(returned) != len(sampled) or any(returned.get((x.prompt_index, x.sample_index, x.step)) != x.logprob
                                            for x in sampled):
        raise CheckFailed("the rollouts' logprobs are not the ones the sampler computed")
    lp_ref, edge = processed_logprobs_fp64(torch.stack([x.logits for x in sampled]), TEMPERATURE, TOP_P)
    tokens = torch.tensor([x.token for x in sampled])
    ref = lp_ref.gather(-1, tokens[:, None])[:, 0]
    on_edge = edge.gather(-1, tokens[:, None])[:, 0]
    outside = ~torch.isfinite(ref) & ~on_edge
    if bool(outside.any()):
        raise CheckFailed(f"{int(outside.sum())} sampled token(s) lie outside the recomputed top-p support")
    keep = ~on_edge
    worst = float((ref[keep] - torch.tensor([x.logprob for x in sampled], dtype=torch.float64)[keep]).abs().max())
    detail = f"{int(keep.sum())} tokens, max |diff| {worst:.2g} nats"
    if bool(on_edge.any()):
        detail += f" ({int(on_edge.sum())} on the top-p edge not compared)"
    if not worst <= LOGPROB_TOL:
        raise CheckFailed(detail)
    return detail


def check_kv_cache(ctx: VerifyContext, scheme: str) -> str | tuple[str, str]:
    """The logits the engine sampled from (prefill + KV-cache decode, batched) vs the engine's own
    no-cache forward over each full sequence, in fp32 activations: temperature-scaled logprobs of
    the sampled tokens (untruncated, so a top-p support change cannot jump the value)."""
    s = get_scheme(scheme)
    if s.activation_granularity == "tensor":
        return SKIP, ("per-tensor activation scales span every token of a forward, so a full-sequence forward "
                      "cannot reproduce decode batches (logprobs are exact for the batch that sampled: see logprobs)")
    try:
        engine = ctx.engine("a", scheme, dtype="fp32")
        rollouts, sampled = _generate_recording(engine, _prompts())
    except RuntimeError as err:
        if not _fp32_fp8_unsupported(ctx.device, s, torch.float32):
            raise
        return SKIP, f"fp32 activations are not supported by this GPU's fp8 kernel ({str(err).splitlines()[0][:80]})"
    full = {(r.prompt_index, r.sample_index): engine.logits(r.prompt_ids + r.response_ids)[len(r.prompt_ids) - 1 :].cpu()
            for r in rollouts}
    cached = torch.stack([x.logits for x in sampled]).double() / TEMPERATURE
    nocache = torch.stack([full[(x.prompt_index, x.sample_index)][x.step] for x in sampled]).double() / TEMPERATURE
    tokens = torch.tensor([x.token for x in sampled])[:, None]
    diff = (torch.log_softmax(cached, -1).gather(-1, tokens) - torch.log_softmax(nocache, -1).gather(-1, tokens)).abs()[:, 0]
    worst, median = float(diff.max()), float(diff.median())
    detail = f"{len(sampled)} tokens, max |diff| {worst:.2g} nats, median {median:.2g}"
    ok = worst <= KV_MAX_TOL_QUANTIZED and median <= KV_TOL if s.is_quantized else worst <= KV_TOL
    if not ok:
        raise CheckFailed(detail)
    return detail


# ------------------------------------------------------------------------------------------------
# (d) vLLM backend
# ------------------------------------------------------------------------------------------------


@contextmanager
def _environ(values: Mapping[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_vllm(ctx: VerifyContext, scheme: str) -> str | tuple[str, str]:
    """vLLM engine on A + WeightSync.push(B) gives the greedy tokens and logprobs of a fresh engine on B."""
    if importlib.util.find_spec("vllm") is None:
        return SKIP, "vLLM is not installed (see docs/vllm.md, Install)"
    from flashrl.vllm_backend.testing import TEST_ENV, load_state_dict, save_char_tokenizer

    for name in ("a", "b"):
        save_char_tokenizer(ctx.checkpoint(name), vocab_size=TINY_MODEL["vocab_size"])
    env = {**{k: os.environ.get(k, v) for k, v in TEST_ENV.items()}, "FLASHRL_CONFIG": None, "FLASHRL_LMHEAD_FP32": None}
    with _environ(env):
        import vllm

        from flashrl.vllm_backend import WeightSync, engine_kwargs

        kwargs = dict(dtype="bfloat16", enforce_eager=True, max_model_len=64, seed=0, max_num_seqs=8,
                      **engine_kwargs(scheme))
        params = vllm.SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
        prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in _token_ids(5, [3, 7, 12])]

        def outputs(llm) -> list[tuple[list[int], list[float]]]:
            return [(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                    for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]

        def shutdown(llm) -> None:
            llm.llm_engine.engine_core.shutdown()

        fresh = vllm.LLM(str(ctx.checkpoint("b")), **kwargs)
        try:
            expected = outputs(fresh)
        finally:
            shutdown(fresh)
        llm = vllm.LLM(str(ctx.checkpoint("a")), **kwargs)
        try:
            before = outputs(llm)
            WeightSync(llm).push(load_state_dict(ctx.checkpoint("b")).items())
            after = outputs(llm)
        finally:
            shutdown(llm)
    if before == expected:
        raise CheckFailed("checkpoints A and B give the same vLLM outputs: the check would prove nothing")
    if after != expected:
        raise CheckFailed(f"{scheme}: greedy outputs after WeightSync.push differ from a fresh vLLM engine")
    return f"vLLM {vllm.__version__}, {scheme}: greedy tokens and logprobs after push equal a fresh engine"


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------

CHECKS: tuple[tuple[str, str, str], ...] = (
    # (name, which schemes, tolerance)
    ("gemm", "quantized", f"int8 acc exact; fp32 rel <= {GEMM_FP32_TOL:g}; bf16 rel <= {GEMM_BF16_TOL:g}"),
    ("reload", "all", "bit-exact"),
    ("logprobs", "all", f"max <= {LOGPROB_TOL:g} nats"),
    ("kv_cache", "all", f"bf16: max <= {KV_TOL:g}; quantized: median <= {KV_TOL:g}, max <= {KV_MAX_TOL_QUANTIZED:g} nats"),
    ("vllm", "one", "equal"),
)


def _check_function(name: str) -> Callable[[VerifyContext, str], Any]:
    return globals()[f"check_{name}"]  # looked up at run time: tests may monkeypatch a check


def _run_one(name: str, fn: Callable[[VerifyContext, str], Any], ctx: VerifyContext, scheme: str,
             tolerance: str) -> CheckResult:
    start = time.perf_counter()
    reason = scheme_unsupported_reason(scheme, ctx.device)
    if reason is not None:
        return CheckResult(name, scheme, SKIP, reason, tolerance)
    try:
        out = fn(ctx, scheme)
        status, detail = out if isinstance(out, tuple) else (PASS, out)
    except CheckFailed as err:
        status, detail = FAIL, str(err)
    except Exception as err:  # noqa: BLE001 - a crash is a failed check, reported in its row
        status, detail = FAIL, f"{type(err).__name__}: {err}"
    return CheckResult(name, scheme, status, detail, tolerance, time.perf_counter() - start)


def run_verify(
    device: str | torch.device | None = None,
    schemes: Sequence[str] | None = None,
    vllm: bool = True,
    progress: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run every check for every scheme (default: all) on `device` (default: cuda if available,
    else cpu); returns one `CheckResult` per row. `vllm=False` reports the vLLM row as SKIP."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = [get_scheme(s).name for s in (schemes or SCHEMES)]
    quantized = [s for s in names if get_scheme(s).is_quantized]
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="flashrl-verify-") as tmp, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ctx = VerifyContext(device=device, root=Path(tmp))
        for name, which, tolerance in CHECKS:
            if name == "vllm":
                scheme = next((s for s in ("int8", *quantized) if s in names and scheme_unsupported_reason(s, device) is None),
                              names[0])
                if not vllm:
                    row = CheckResult(name, scheme, SKIP, "disabled (--no-vllm)", tolerance)
                else:
                    row = _run_one(name, _check_function(name), ctx, scheme, tolerance)
                rows = [row]
            else:
                rows = [_run_one(name, _check_function(name), ctx, s, tolerance)
                        for s in (quantized if which == "quantized" else names)]
            for row in rows:
                results.append(row)
                if progress is not None:
                    progress(row)
    return results


def format_results(results: Sequence[CheckResult], device: torch.device | str, seconds: float) -> str:
    """The PASS/FAIL table and a one-line summary."""
    rows = [{"check": r.check, "scheme": r.scheme, "status": r.status, "detail": r.detail, "tolerance": r.tolerance,
             "s": f"{r.seconds:.2f}"} for r in results]
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    failed = [f"{r.check}[{r.scheme}]" for r in results if r.status == FAIL]
    summary = (f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped on {device_name(device)} "
               f"in {seconds:.1f} s")
    if failed:
        summary += f"; FAILED: {', '.join(failed)}"
    return format_table(rows, ["check", "scheme", "status", "detail", "tolerance", "s"]) + "\n" + summary


def results_json(results: Sequence[CheckResult], device: torch.device | str, seconds: float) -> dict[str, Any]:
    return {"device": str(device), "device_name": device_name(device), "seconds": seconds,
            "passed": not any(r.status == FAIL for r in results), "results": [asdict(r) for r in results]}


def exit_code(results: Sequence[CheckResult]) -> int:
    """1 when any row failed, else 0 (SKIP rows do not fail the run)."""
    return 1 if any(r.status == FAIL for r in results) else 0
