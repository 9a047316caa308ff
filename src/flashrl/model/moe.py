"""The sparse MoE block of the decoder: a router kept in high precision, top-k routing, and
experts as SwiGLU MLPs stored stacked (`flashrl.quant.experts`), grouped by expert.

Numerics follow `transformers` 5.x (qwen3_moe, qwen2_moe, mixtral modeling files and the default
``grouped_mm`` experts implementation of `transformers.integrations.moe`):

1. router logits ``x @ W_gate^T`` in the activation dtype (the router is never quantized);
2. ``softmax`` in fp32, ``topk`` (ids in descending probability), then the top-k weights are
   renormalised to sum 1 where the family says so (`MoEConfig.norm_topk_prob`; always for Mixtral);
   Qwen casts them to the logits' dtype, Mixtral keeps them fp32;
3. each (token, expert) pair computes ``down(silu(gate(x)) * up(x))`` with expert e's weights;
   pairs are sorted by expert id and each expert with tokens runs one GEMM over its rows (no
   per-token loop; the quantized GEMM is `QuantLinear`'s, per expert);
4. each pair's output times its weight, summed over the k pairs of a token, cast to the activation
   dtype; Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

Routing observation: `routing_observer(moe_index, ids)` (set by `Decoder.set_routing_observer`)
sees the top-k ids [tokens, k] of every forward (the engine's routing capture).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashrl.errors import UnsupportedError
from flashrl.model.batch import ForwardBatch, masked_rows
from flashrl.model.moe_config import MoEConfig
from flashrl.quant.dispatch import quantize_activation
from flashrl.quant.experts import DenseExperts, QuantExperts, make_experts
from flashrl.quant.linear import DenseLinear
from flashrl.quant.schemes import QuantScheme

RoutingObserver = Callable[[int, torch.Tensor], None]


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k weights and expert ids [tokens, k] from router logits [tokens, E] (module doc, 2)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.weights_in_router_dtype:
        weights = weights.to(logits.dtype)
    return weights, ids


def replay_weights(logits: torch.Tensor, ids: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """The top-k weights `route` gives to given expert `ids` (routing replay)."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if moe.weights_in_router_dtype else weights


def grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: QuantExperts | DenseExperts,
    down: QuantExperts | DenseExperts,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for x [T, H]: (token, expert) pairs
    sorted by expert. Unquantized experts run two grouped GEMMs (`grouped_mm_available`);
    quantized ones one GEMM per expert with tokens and projection (one host sync for the
    counts), with the same kernels as `QuantLinear`."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]
    if isinstance(gate_up, DenseExperts) and grouped_mm_available(x):
        out = _grouped_dense_experts(xs, flat, gate_up, down)
        return _combine(out, order, weights, tokens, k, x.dtype)
    counts = torch.bincount(flat, minlength=gate_up.num_experts).tolist()
    starts = [sum(counts[:e]) for e in range(len(counts))]
    active = [(e, slice(starts[e], starts[e] + c)) for e, c in enumerate(counts) if c]
    if isinstance(gate_up, QuantExperts) and gate_up.scheme.activation_granularity == "token":
        out = _token_quantized_experts(xs, active, gate_up, down)
    else:
        out = torch.empty(tokens * k, x.shape[-1], dtype=x.dtype, device=x.device)
        inter = gate_up.out_features // 2
        for expert, rows in active:
            gate, up = gate_up.linear(xs[rows], expert).split(inter, dim=-1)
            out[rows] = down.linear(F.silu(gate) * up, expert)
    return _combine(out, order, weights, tokens, k, x.dtype)


def _combine(
    out: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    tokens: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Expert outputs of the sorted pairs times their weights, back in token order, summed over
    each token's k pairs (as transformers' grouped_mm experts)."""
    weighted = out * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(tokens, k, -1).sum(dim=1).to(dtype)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch.nn.functional.grouped_mm` serves unquantized experts for `x`: on the CPU
    (any float dtype), and on CUDA for bf16 on compute capability 8.0 or newer (torch's kernel
    requirements); elsewhere the per-expert loop runs. A speed choice: the CPU tests check that
    both give the same bits (tests/test_moe_experts.py)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def _grouped_dense_experts(
    xs: torch.Tensor, flat_ids: torch.Tensor, gate_up: DenseExperts, down: DenseExperts
) -> torch.Tensor:
    """Unquantized experts as two grouped GEMMs over the expert-sorted rows `xs` (no host sync,
    no per-expert Python loop); `flat_ids` are the pairs' expert ids (unsorted)."""
    counts = torch.bincount(flat_ids, minlength=gate_up.num_experts)
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    inter = gate_up.out_features // 2
    hidden = F.grouped_mm(xs, gate_up.weight.transpose(-2, -1), offs=offsets)
    act = F.silu(hidden[:, :inter]) * hidden[:, inter:]
    return F.grouped_mm(act, down.weight.transpose(-2, -1), offs=offsets)


def _token_quantized_experts(
    xs: torch.Tensor, active: list[tuple[int, slice]], gate_up: QuantExperts, down: QuantExperts
) -> torch.Tensor:
    """The expert SwiGLUs of per-token schemes (int8, fp8_channel) with each projection's input
    quantized once for all experts: per-token codes are row-local, so every expert's GEMM sees
    the bits `QuantExperts.linear` would make (tests/test_moe_experts.py)."""
    scheme, inter = gate_up.scheme, gate_up.out_features // 2
    xq, x_scale = quantize_activation(xs, scheme)
    hidden = torch.empty(xs.shape[0], 2 * inter, dtype=xs.dtype, device=xs.device)
    for expert, rows in active:
        hidden[rows] = gate_up.linear_prequantized(xq[rows], x_scale[rows], expert, xs.dtype)
    act = F.silu(hidden[:, :inter]) * hidden[:, inter:]
    aq, a_scale = quantize_activation(act, scheme)
    out = torch.empty(xs.shape[0], down.out_features, dtype=xs.dtype, device=xs.device)
    for expert, rows in active:
        out[rows] = down.linear_prequantized(aq[rows], a_scale[rows], expert, xs.dtype)
    return out


class MoEBlock(nn.Module):
    """One sparse MoE MLP; module names mirror `transformers` (``gate``, ``experts``,
    ``shared_expert``, ``shared_expert_gate``); ``experts`` holds ``gate_up_proj`` [E, 2I, H]
    (shards gate, up) and ``down_proj`` [E, H, I]."""

    def __init__(
        self,
        moe: MoEConfig,
        hidden_size: int,
        index: int,
        expert_scheme: QuantScheme,
        shared_expert: nn.Module | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.moe, self.index = moe, index
        """`index`: this block's position among the model's MoE layers (routing records)."""
        e, i, h = moe.num_experts, moe.expert_intermediate_size, hidden_size
        self.gate = DenseLinear(h, e, dtype=dtype, device=device)
        self.experts = nn.Module()
        self.experts.gate_up_proj = make_experts(e, h, 2 * i, expert_scheme, (i, i), dtype, device)
        self.experts.down_proj = make_experts(e, i, h, expert_scheme, None, dtype, device)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            DenseLinear(h, 1, dtype=dtype, device=device) if shared_expert is not None else None
        )
        self.routing_observer: RoutingObserver | None = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            raise UnsupportedError(
                "MoE layers run eagerly: EngineConfig(decode_compile=...) is not supported for MoE "
                "models (grouping tokens by expert has data-dependent shapes); use "
                "decode_compile=None"
            )
        shape = x.shape
        flat = masked_rows(x, batch).reshape(-1, shape[-1])
        weights, ids = route(self.gate(flat), self.moe)
        if self.routing_observer is not None:
            self.routing_observer(self.index, ids)
        out = grouped_experts(flat, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)
