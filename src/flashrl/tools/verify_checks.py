"""The checks of `flashrl verify` that need no vLLM: `gemm`, `update`, `logprobs`, `kv_cache`
(what each compares and its tolerance: the table in `flashrl.tools.verify`). Each takes the shared
`VerifyContext` and a scheme and returns the row's detail (or ``(status, detail)``), raising
`CheckFailed` with the detail when the comparison fails."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine
from flashrl.engine.sampler import SampledTokens
from flashrl.model.weights import iter_checkpoint
from flashrl.quant import dispatch, gemm
from flashrl.quant.linear import QuantLinear
from flashrl.quant.schemes import QuantScheme, get_scheme
from flashrl.tools.verify_context import (
    GEMM_BF16_TOL,
    GEMM_FP32_TOL,
    KV_MAX_TOL_QUANTIZED,
    KV_TOL,
    LOGPROB_TOL,
    SKIP,
    TEMPERATURE,
    TOP_P,
    TOP_P_BOUNDARY,
    CheckFailed,
    VerifyContext,
    fp32_fp8_unsupported,
    token_ids,
)

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
    """Quantizer round-trip, the int8 accumulator, and `QuantLinear` outputs vs float64
    references."""
    s = get_scheme(scheme)
    worst_fp32 = worst_bf16 = 0.0
    fp32_note = ""
    for m in (5, 40):  # 5 < 17 exercises the CUDA row padding of _int_mm
        x, w, b = _gemm_inputs(ctx.device, m, seed=m)
        linear = torch.nn.Linear(
            w.shape[1], w.shape[0], bias=True, dtype=torch.bfloat16, device=ctx.device
        )
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
            raise CheckFailed(
                f"quantizer: |W - deq(Q(W))| exceeds the round-to-nearest bound by "
                f"{float((err - bound).max()):.3g} (M={m})"
            )
        for x_in in (x.float(), x.to(torch.bfloat16)):  # fp32 and bf16 activations (and outputs)
            xq, x_scale = dispatch.quantize_activation(x_in, s)
            if s.code_dtype == torch.int8:
                int8_mm = gemm.int8_mm_cuda if xq.is_cuda else gemm.int8_mm_cpu
                acc = int8_mm(xq, layer.weight)
                exact = xq.cpu().to(torch.int64) @ layer.weight.cpu().to(torch.int64).t()
                if acc.dtype != torch.int32 or not torch.equal(acc.cpu().to(torch.int64), exact):
                    diff = (acc.cpu().to(torch.int64) - exact).abs().max()
                    raise CheckFailed(
                        f"int8 accumulator differs from integer math (max |diff| "
                        f"{int(diff)}, M={m})"
                    )
            ref = _dequantize_activation(xq, x_scale, s) @ w_deq.t() + b.double()
            try:
                y = layer(x_in)
            except RuntimeError as err:
                if not fp32_fp8_unsupported(ctx.device, s, x_in.dtype):
                    raise
                first = str(err).splitlines()[0][:80]
                fp32_note = f"fp32 out not supported by this GPU's fp8 kernel ({first})"
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
        return (
            layer.weight_scale.double()
            .repeat_interleave(bn, 0)[: shape[0]]
            .repeat_interleave(bk, 1)[:, : shape[1]]
        )
    scale = layer.row_scale[:, None] if layer.row_scale is not None else layer.weight_scale
    return (
        scale.double().reshape(-1, 1).expand(shape)
        if scale.numel() > 1
        else scale.double().reshape(1, 1).expand(shape)
    )


def _dequantize_activation(xq: torch.Tensor, x_scale: torch.Tensor, s: QuantScheme) -> torch.Tensor:
    if s.activation_granularity == "group":
        return xq.double() * x_scale.double().repeat_interleave(s.group_size, 1)[:, : xq.shape[1]]
    return (
        xq.double() * x_scale.double().reshape(-1, 1)
        if x_scale.numel() > 1
        else xq.double() * x_scale.double()
    )


# ------------------------------------------------------------------------------------------------
# (a) update exactness
# ------------------------------------------------------------------------------------------------


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _update_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """q, k, v, gate and up tensors each in their own call (partial fused updates), then the
    rest."""
    parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    groups = [[(n, t) for n, t in tensors.items() if f".{p}." in n] for p in parts]
    rest = [(n, t) for n, t in tensors.items() if not any(f".{p}." in n for p in parts)]
    return [g for g in groups if g] + [rest]


def check_update(ctx: VerifyContext, scheme: str) -> str:
    """update_weights(B) into an engine loaded from A equals a fresh load of B, bit for bit, in
    place."""
    engine = ctx.engine("a", scheme)
    ids = token_ids(11, [24])[0]
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
        worst = float((after - expected).abs().max())
        raise CheckFailed(f"logits after update differ from a fresh load (max |diff| {worst:.3g})")
    mine, theirs = _tensors(engine.model), _tensors(fresh.model)
    for name, tensor in mine.items():
        other = theirs[name]
        if tensor.dtype != other.dtype or not torch.equal(
            tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor,
            other.view(torch.uint8) if other.element_size() == 1 else other,
        ):
            raise CheckFailed(f"{name} differs from a fresh load")
    moved = [n for n, t in mine.items() if t.data_ptr() != pointers[n]]
    if moved:
        raise CheckFailed(f"storage replaced instead of updated in place: {', '.join(moved[:3])}")
    return (
        f"{len(groups)} update calls; logits and {len(mine)} tensors bit-equal to a fresh "
        f"load; storage in place"
    )


# ------------------------------------------------------------------------------------------------
# (b) logprob exactness
# ------------------------------------------------------------------------------------------------


def processed_logprobs_fp64(
    logits: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
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
class Sampled:
    """One sampled token as the engine produced it: its request, step, the fp32 logits row the
    sampler received, the token and the logprob it returned."""

    prompt_index: int
    sample_index: int
    step: int
    logits: torch.Tensor
    token: int
    logprob: float


def generate_recording(engine: Engine, prompts: list[list[int]]) -> tuple[list[Any], list[Sampled]]:
    """`engine.generate` with every sampling step recorded (`Engine.add_sample_observer`)."""
    sampled: list[Sampled] = []

    def observe(record: SampledTokens) -> None:
        for k, token in enumerate(record.tokens):
            sampled.append(
                Sampled(
                    record.prompt_index[k],
                    record.sample_index[k],
                    record.step[k],
                    record.logits[k].detach().float().cpu().clone(),
                    int(token),
                    float(record.logprobs[k]),
                )
            )

    remove = engine.add_sample_observer(observe)
    try:
        rollouts = engine.generate(prompts, sampling_params())
    finally:
        remove()
    return rollouts, sampled


def sampling_params() -> SamplingParams:
    # Stop tokens end sequences at different steps and max_batch=4 < 8 requests: slots are freed,
    # compacted and refilled mid-decode, so continuous batching is part of what is checked.
    return SamplingParams(
        temperature=TEMPERATURE,
        top_p=TOP_P,
        max_tokens=16,
        n=2,
        seed=1234,
        ignore_eos=True,
        stop_token_ids=tuple(range(3, 23)),
    )


def prompts() -> list[list[int]]:
    return token_ids(5, [3, 7, 12, 20])


def check_logprobs(ctx: VerifyContext, scheme: str) -> str:
    """Every sampled token's returned logprob (T=0.7, top-p 0.9) vs a float64 recomputation of the
    processed distribution from the fp32 logits the engine sampled from."""
    engine = ctx.engine("a", scheme)
    rollouts, sampled = generate_recording(engine, prompts())
    returned = {
        (r.prompt_index, r.sample_index, t): lp for r in rollouts for t, lp in enumerate(r.logprobs)
    }
    if len(returned) != len(sampled) or any(
        returned.get((x.prompt_index, x.sample_index, x.step)) != x.logprob for x in sampled
    ):
        raise CheckFailed("the rollouts' logprobs are not the ones the sampler computed")
    lp_ref, edge = processed_logprobs_fp64(
        torch.stack([x.logits for x in sampled]), TEMPERATURE, TOP_P
    )
    tokens = torch.tensor([x.token for x in sampled])
    ref = lp_ref.gather(-1, tokens[:, None])[:, 0]
    on_edge = edge.gather(-1, tokens[:, None])[:, 0]
    outside = ~torch.isfinite(ref) & ~on_edge
    if bool(outside.any()):
        raise CheckFailed(
            f"{int(outside.sum())} sampled token(s) lie outside the recomputed top-p support"
        )
    keep = ~on_edge
    worst = float(
        (ref[keep] - torch.tensor([x.logprob for x in sampled], dtype=torch.float64)[keep])
        .abs()
        .max()
    )
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
        return SKIP, (
            "per-tensor activation scales span every token of a forward, so a "
            "full-sequence forward cannot reproduce decode batches (logprobs are exact "
            "for the batch that sampled: see logprobs)"
        )
    try:
        engine = ctx.engine("a", scheme, dtype="fp32")
        rollouts, sampled = generate_recording(engine, prompts())
    except RuntimeError as err:
        if not fp32_fp8_unsupported(ctx.device, s, torch.float32):
            raise
        first = str(err).splitlines()[0][:80]
        return SKIP, f"fp32 activations are not supported by this GPU's fp8 kernel ({first})"
    full = {
        (r.prompt_index, r.sample_index): engine.logits(r.prompt_ids + r.response_ids)[
            len(r.prompt_ids) - 1 :
        ].cpu()
        for r in rollouts
    }
    cached = torch.stack([x.logits for x in sampled]).double() / TEMPERATURE
    nocache = (
        torch.stack([full[(x.prompt_index, x.sample_index)][x.step] for x in sampled]).double()
        / TEMPERATURE
    )
    tokens = torch.tensor([x.token for x in sampled])[:, None]
    diff = (
        torch.log_softmax(cached, -1).gather(-1, tokens)
        - torch.log_softmax(nocache, -1).gather(-1, tokens)
    ).abs()[:, 0]
    worst, median = float(diff.max()), float(diff.median())
    detail = f"{len(sampled)} tokens, max |diff| {worst:.2g} nats, median {median:.2g}"
    ok = worst <= KV_MAX_TOL_QUANTIZED and median <= KV_TOL if s.is_quantized else worst <= KV_TOL
    if not ok:
        raise CheckFailed(detail)
    return detail
