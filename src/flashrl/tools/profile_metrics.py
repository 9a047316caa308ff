"""What `flashrl profile` measures: per-layer quantization errors on calibration activations, the
skip recommendation, and the end-to-end mismatch of a quantized engine against the bf16 one
(fields: docs/profile.md)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from flashrl.core.rollout import Rollout
from flashrl.correction import mismatch_metrics
from flashrl.engine import Engine
from flashrl.model.batch import ForwardBatch, pad_right
from flashrl.model.decoder import GATE_UP_SHARDS, QKV_SHARDS
from flashrl.model.moe import MoEBlock
from flashrl.quant.linear import DenseLinear, QuantLinear
from flashrl.tools.profile_experts import expert_errors, is_router

logger = logging.getLogger(__name__)

FUSED_SHARDS = {"qkv_proj": QKV_SHARDS, "gate_up_proj": GATE_UP_SHARDS}


def shard_names(engine_name: str, num_shards: int) -> list[str]:
    """HF checkpoint names of an engine layer's shards: layers.0.self_attn.qkv_proj ->
    model.layers.0.self_attn.{q,k,v}_proj."""
    parent, _, leaf = engine_name.rpartition(".")
    parts = FUSED_SHARDS.get(leaf, (leaf,))
    if len(parts) != num_shards:
        raise ValueError(
            f"engine layer {engine_name} has {num_shards} shard(s); expected {len(parts)}"
        )
    return [f"model.{parent}.{p}" for p in parts]


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.double().norm())
    if denom > 0:
        return float(diff.double().norm()) / denom
    return 0.0 if float(diff.double().norm()) == 0 else math.inf


def _amax_ratio(t: torch.Tensor) -> float:
    t = t.double()
    rms = float(t.pow(2).mean().sqrt())
    return float(t.abs().max()) / rms if rms > 0 else 0.0


def _quantized_output(
    module: DenseLinear, scheme: str, name: str, x: torch.Tensor
) -> tuple[QuantLinear, torch.Tensor]:
    """`module` quantized with `scheme` and its output on `x`, in fp32 where the GEMM allows (the
    bf16 output rounding is not quantization error)."""
    q = QuantLinear.from_linear(module, scheme, shard_sizes=module.shard_sizes)
    try:
        return q, q(x.float())
    except RuntimeError:
        if x.device.type != "cuda":
            raise
        # Some CUDA fp8 kernels only produce bf16: measured with that rounding (about 0.2 %).
        logger.warning(
            "profile: %s on %s: fp32 output refused by the GEMM; measuring with bf16 output",
            scheme,
            name,
        )
        return q, q(x.to(module.weight.dtype)).float()


def _shard_errors(
    name: str, module: DenseLinear, x: torch.Tensor, schemes: Sequence[str]
) -> list[dict[str, Any]]:
    """The layer entries (one per checkpoint shard) of engine layer `name` on its inputs `x`."""
    w = module.weight.float()
    y_ref = x.float() @ w.t()
    if module.bias is not None:
        y_ref += module.bias.float()
    entries = []
    for i, hf_name in enumerate(shard_names(name, len(module.shard_sizes))):
        start, end = module.shard_rows(i)
        entries.append(
            {
                "name": hf_name,
                "engine_layer": f"model.{name}",
                "shape": [end - start, module.in_features],
                "tokens": int(x.shape[0]),
                "weight_amax_ratio": _amax_ratio(w[start:end]),
                "input_amax_ratio": _amax_ratio(x),
                "errors": {},
            }
        )
    for scheme in schemes:
        q, y_q = _quantized_output(module, scheme, name, x)
        w_deq = q.dequantized_weight(torch.float32)
        for i, entry in enumerate(entries):
            rows = slice(*module.shard_rows(i))
            entry["errors"][scheme] = {
                "weight_error": _rel(w_deq[rows] - w[rows], w[rows]),
                "output_error": _rel(y_q[:, rows] - y_ref[:, rows], y_ref[:, rows]),
            }
        del q, w_deq, y_q
    return entries


@torch.no_grad()
def layer_errors(
    engine: Engine, sequences: list[list[int]], schemes: Sequence[str]
) -> list[dict[str, Any]]:
    """Per checkpoint tensor: weight and output errors of every scheme on the inputs the bf16
    `engine` sees over `sequences` (one batched no-cache forward, right-padded; padding rows are
    dropped). MoE layers: one entry per expert tensor (`flashrl.tools.profile_experts`); routers
    are never quantized and not listed."""
    layers = [
        (name, m)
        for name, m in engine.model.named_modules()
        if isinstance(m, DenseLinear) and name.startswith("layers.") and not is_router(name)
    ]
    blocks = [(n, m) for n, m in engine.model.named_modules() if isinstance(m, MoEBlock)]
    batch = pad_right(sequences, engine.device)
    valid = batch.valid.flatten()
    rows: list[dict[str, Any]] = []

    def hook(name: str):
        def fn(module: DenseLinear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, module.in_features)[valid]
            rows.extend(_shard_errors(name, module, x, schemes))

        return fn

    def moe_hook(name: str):
        def fn(module: MoEBlock, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])[valid]
            rows.extend(expert_errors(name, module, x, schemes, _shard_errors))

        return fn

    handles = [m.register_forward_hook(hook(name)) for name, m in layers]
    handles += [m.register_forward_hook(moe_hook(name)) for name, m in blocks]
    try:
        width = batch.ids.shape[1]
        positions = torch.arange(width, device=engine.device).expand(len(sequences), width)
        engine.model.hidden_states(batch.ids, ForwardBatch(positions=positions))
    finally:
        for h in handles:
            h.remove()
    return rows


def recommend_skip(
    layers: list[dict[str, Any]], scheme: str, threshold: float
) -> list[dict[str, Any]]:
    """Engine layers with a shard whose output error exceeds `threshold`, worst first: each with
    its `engine_layer`, all shard `names` and the max `output_error`."""
    flagged: dict[str, dict[str, Any]] = {}
    for entry in layers:
        err = entry["errors"][scheme]["output_error"]
        item = flagged.setdefault(
            entry["engine_layer"],
            {"engine_layer": entry["engine_layer"], "names": [], "output_error": 0.0},
        )
        item["names"].append(entry["name"])
        item["output_error"] = max(item["output_error"], err)
    chosen = [f for f in flagged.values() if f["output_error"] > threshold]
    return sorted(chosen, key=lambda f: -f["output_error"])


@torch.no_grad()
def distribution_mismatch(
    reference: Engine,
    engine: Engine,
    sequences: list[list[int]],
    temperature: float = 1.0,
    reference_logits: Sequence[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Full-vocabulary comparison in fp64 of `engine` (q) with `reference` (p) at every position of
    `sequences` (no-cache forwards); fields as in the module doc's ``exact``. `reference_logits`:
    the reference's `logits` of each sequence, computed once by a caller that compares many engines
    against it (the same numbers, without a reference forward per engine)."""
    sums = dict(kl=0.0, reverse_kl=0.0, tv=0.0, rollout_probs_diff_mean=0.0, top1_agreement=0.0)
    kl_max = diff_max = 0.0
    positions = 0
    for i, seq in enumerate(sequences):
        ref = reference.logits(seq) if reference_logits is None else reference_logits[i]
        lp = torch.log_softmax(ref.double() / temperature, dim=-1)
        lq = torch.log_softmax(engine.logits(seq).double() / temperature, dim=-1)
        p, q = lp.exp(), lq.exp()
        diff = (q - p).abs()
        kl = (q * (lq - lp)).sum(-1)
        sums["kl"] += float(kl.sum())
        sums["reverse_kl"] += float((p * (lp - lq)).sum())
        sums["tv"] += 0.5 * float(diff.sum())
        sums["rollout_probs_diff_mean"] += float((q * diff).sum())
        sums["top1_agreement"] += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        kl_max = max(kl_max, float(kl.max()))
        diff_max = max(diff_max, float(diff.max()))
        positions += len(seq)
    out = {k: v / positions for k, v in sums.items()}
    out.update(kl_max=kl_max, rollout_probs_diff_max=diff_max, positions=positions)
    return {
        k: out[k]
        for k in (
            "kl",
            "kl_max",
            "reverse_kl",
            "tv",
            "rollout_probs_diff_max",
            "rollout_probs_diff_mean",
            "top1_agreement",
            "positions",
        )
    }


@torch.no_grad()
def sampled_mismatch(
    reference: Engine, rollouts: list[Rollout], temperature: float = 1.0
) -> dict[str, float]:
    """`flashrl.correction.mismatch_metrics` of rollouts (the engine's sampled logprobs) against the
    reference engine's rescoring of the same tokens: what training logs at step 0."""
    rollouts = [r for r in rollouts if r.response_ids]
    width = max(len(r.response_ids) for r in rollouts)
    lp_roll = torch.zeros(len(rollouts), width)
    lp_train = torch.zeros(len(rollouts), width)
    mask = torch.zeros(len(rollouts), width, dtype=torch.bool)
    for i, r in enumerate(rollouts):
        n = len(r.response_ids)
        lp_roll[i, :n] = torch.tensor(r.logprobs)
        scores = reference.score(r.prompt_ids, r.response_ids, temperature=temperature)
        lp_train[i, :n] = torch.tensor(scores)
        mask[i, :n] = True
    metrics = mismatch_metrics(lp_train, lp_roll, mask)
    metrics["tokens"] = int(mask.sum())
    return metrics
