"""The decoder, written for inference: fused projections, a slot KV cache, logits only where needed.

One class covers the Llama, Mistral, Qwen2 and Qwen3 families (`ModelConfig` lists what differs) and
the MoE families Qwen3-MoE, Qwen2-MoE and Mixtral, whose sparse layers use `flashrl.model.moe`.
Numerics follow the reference `transformers` implementations so that bf16/fp32 logits agree:
RMSNorm in fp32 then cast back before the weight multiply; RoPE tables computed in fp32 and cast to
the activation dtype; SwiGLU ``down(silu(gate(x)) * up(x))``; attention scaled by 1/sqrt(head_dim).

Linear layers come from `flashrl.quant.linear.make_linear`, so one model serves every scheme:
q/k/v are fused into `qkv_proj` (shards q, k, v) and gate/up into `gate_up_proj` (shards gate, up).
The LM head and embeddings stay unquantized; with `lm_head_fp32` the head weight and the logits
are fp32 end to end (the final hidden state is upcast before the head matmul).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashrl.model.batch import ForwardBatch, masked_rows
from flashrl.model.config import ModelConfig, rope_inv_freq
from flashrl.model.moe import MoEBlock, RoutingObserver
from flashrl.quant.linear import DenseLinear, make_linear, matches_any
from flashrl.quant.schemes import QuantScheme, get_scheme

QKV_SHARDS = ("q_proj", "k_proj", "v_proj")
GATE_UP_SHARDS = ("gate_proj", "up_proj")


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention output [B, heads, T, D] for q [B, heads, T, D] and k, v [B, kv_heads, S, D] (GQA:
    each kv head serves heads // kv_heads consecutive query heads); `mask` [B or 1, 1, T, S]
    (True = attend) or None for causal.

    Decode (T == 1) with GQA runs grouped: the query heads of one kv head become that kv head's
    query rows, q viewed as [B, kv_heads, group, D] against k, v as they are, so SDPA sees no GQA.
    On CUDA, PyTorch's SDPA supports GQA only in its flash kernel, which takes no mask, and in its
    math kernel, which copies K and V `group` times (in fp32 for bf16 inputs) at every step; the
    grouped form with a mask can run the memory-efficient (or cuDNN) kernel over the cache as
    stored. On the CPU both forms run at the same speed (tiny-bench decode, within run-to-run
    noise); one form on every device keeps the path the CPU tests check the one a GPU runs. Same
    result as the GQA call up to float summation order
    (tests/test_engine.py::test_attend_equals_float64_reference)."""
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    if t == 1 and heads != kv_heads:
        out = F.scaled_dot_product_attention(
            q.reshape(b, kv_heads, heads // kv_heads, d), k, v, attn_mask=mask, scale=scale
        )
        return out.reshape(b, heads, 1, d)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and t > 1,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for positions 0..max_len-1, rotate-half convention (as transformers)."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D], positions [B, T]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, scheme_for, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layer, self.config = layer, config
        h, d = config.hidden_size, config.head_dim
        self.qkv_proj = make_linear(
            h,
            config.q_size + 2 * config.kv_size,
            scheme_for("self_attn.qkv_proj", QKV_SHARDS),
            bias=config.qkv_bias,
            shard_sizes=(config.q_size, config.kv_size, config.kv_size),
            dtype=dtype,
            device=device,
        )
        self.o_proj = make_linear(
            config.q_size,
            h,
            scheme_for("self_attn.o_proj", ("o_proj",)),
            bias=config.o_proj_bias,
            dtype=dtype,
            device=device,
        )
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.config
        q, k, v = self.qkv_proj(masked_rows(x, batch)).split(
            [c.q_size, c.kv_size, c.kv_size], dim=-1
        )
        q = q.view(b, t, c.num_heads, c.head_dim)
        k = k.view(b, t, c.num_kv_heads, c.head_dim)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q.transpose(1, 2), batch.positions)
        k = rotary(k.transpose(1, 2), batch.positions)
        if batch.kv_observer is not None:
            batch.kv_observer(self.layer, q, k, v)
        cache = batch.cache
        if cache is not None and batch.decode:
            valid = batch.row_mask.view(-1) if batch.row_mask is not None else None
            cache.write_decode(
                self.layer, batch.positions[:, 0], k[:, :, 0], v[:, :, 0], valid=valid
            )
            k, v = cache.read(self.layer, b, batch.kv_length)
        elif cache is not None:
            # Attention always uses K/V as the cache stores them: with an fp8 cache, the prefill
            # too attends over the dequantized codes, so a token's logits do not depend on whether
            # it was prefilled or decoded (as in vLLM, whose prefill reads the cache). Q is never
            # quantized.
            k, v = cache.write_prefill(self.layer, batch.slots, k, v)
        out = attend(q, k.to(q.dtype), v.to(q.dtype), batch.mask, self.scale)
        return self.o_proj(masked_rows(out.transpose(1, 2).reshape(b, t, c.q_size), batch))


class MLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        scheme_for,
        dtype: torch.dtype,
        device: torch.device,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate = i
        self.gate_up_proj = make_linear(
            h,
            2 * i,
            scheme_for("mlp.gate_up_proj", GATE_UP_SHARDS),
            bias=config.mlp_bias,
            shard_sizes=(i, i),
            dtype=dtype,
            device=device,
        )
        self.down_proj = make_linear(
            i,
            h,
            scheme_for("mlp.down_proj", ("down_proj",)),
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(masked_rows(x, batch)).split(self.intermediate, dim=-1)
        return self.down_proj(masked_rows(F.silu(gate) * up, batch))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, scheme_for, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}."
        self.self_attn = Attention(
            config,
            layer,
            lambda n, s: scheme_for(prefix + n, [prefix + "self_attn." + x for x in s]),
            dtype,
            device,
        )
        moe = config.moe
        if moe is not None and layer in moe.sparse_layers:
            self.mlp = _moe_block(config, layer, scheme_for, dtype, device)
        else:
            self.mlp = MLP(
                config,
                lambda n, s: scheme_for(prefix + n, [prefix + "mlp." + x for x in s]),
                dtype,
                device,
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rotary: Rotary) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, rotary)
        return h + self.mlp(self.post_attention_layernorm(h), batch)


def _moe_block(
    config: ModelConfig, layer: int, scheme_for, dtype: torch.dtype, device: torch.device
) -> MoEBlock:
    """Layer `layer`'s MoE block: experts under the scheme of ``model.layers.L.mlp.experts``, the
    Qwen2-MoE shared expert under its own names; router and shared-expert gate in high precision."""
    moe, prefix = config.moe, f"model.layers.{layer}.mlp."
    shared = None
    if moe.shared_expert_intermediate_size:
        shared = MLP(
            config,
            lambda n, s: scheme_for(
                prefix + n.replace("mlp.", "shared_expert."),
                [prefix + "shared_expert." + x for x in s],
            ),
            dtype,
            device,
            intermediate_size=moe.shared_expert_intermediate_size,
        )
    # like a fused layer: one skipped expert tensor (any naming) keeps the layer's experts in bf16
    block = f"model.layers.{layer}.{moe.checkpoint_block}."
    hf_names = [prefix + "experts.gate_up_proj", prefix + "experts.down_proj"] + [
        f"{p}experts.{e}.{n}"
        for p in {prefix, block}
        for e in range(moe.num_experts)
        for n in (*moe.expert_names, "gate_proj", "up_proj", "down_proj")
    ]
    experts = scheme_for(prefix + "experts", hf_names)
    index = moe.sparse_layers.index(layer)
    return MoEBlock(moe, config.hidden_size, index, experts, shared, dtype, device)


class Decoder(nn.Module):
    """The whole causal LM. Module names mirror the Hugging Face ones, q/k/v and gate/up fused."""

    def __init__(
        self,
        config: ModelConfig,
        scheme: str | QuantScheme = "bf16",
        skip: tuple[str, ...] = (),
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        max_len: int = 4096,
        lm_head_fp32: bool = False,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        scheme = get_scheme(scheme)
        bf16 = get_scheme("bf16")

        def scheme_for(name: str, hf_names: list[str]) -> QuantScheme:
            """A fused layer stays in high precision if its own name or a shard's HF name is
            skipped."""
            return (
                bf16
                if matches_any(name, skip) or any(matches_any(n, skip) for n in hf_names)
                else scheme
            )

        self.config, self.dtype, self.lm_head_fp32 = config, dtype, lm_head_fp32
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, scheme_for, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        head_dtype = torch.float32 if lm_head_fp32 else dtype
        self.lm_head = DenseLinear(
            config.hidden_size, config.vocab_size, dtype=head_dtype, device=device
        )
        if config.tie_word_embeddings and not lm_head_fp32:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, max_len, device)
        self.sliding_window = config.sliding_window

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks in layer order (empty for a dense model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def set_routing_observer(self, observer: RoutingObserver | None) -> None:
        """Call ``observer(moe_index, ids)`` with every MoE block's top-k ids (None: stop)."""
        for block in self.moe_blocks():
            block.routing_observer = observer

    def hidden_states(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] for token ids [B, T]."""
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, batch, self.rotary)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits. With `lm_head_fp32` the matmul itself runs in fp32; otherwise the logits are
        computed in the model dtype and then upcast."""
        if self.lm_head_fp32:
            return self.lm_head(hidden.float())
        return self.lm_head(hidden).float()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full causal forward without a cache: fp32 logits [B, T, vocab]."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
        batch = ForwardBatch.causal(positions, self.sliding_window)
        return self.logits(self.hidden_states(input_ids, batch))
