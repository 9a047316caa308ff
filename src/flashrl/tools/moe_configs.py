"""MoE model dimensions for `flashrl bench --random-weights NAME` (and benchmarks/bench_moe.py).

`qwen3-30b-a3b` copies the public Qwen3-30B-A3B config.json (48 layers, 128 experts, top-8, expert
intermediate 768); `tiny-moe-bench` and `mid-moe-bench` are made-up Qwen3-MoE shapes that run on a
CPU (16 experts top-2 at hidden 512; 32 experts top-4 at hidden 1024).
"""

from __future__ import annotations

_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    rope_theta=1000000.0,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

MOE_RANDOM_CONFIGS: dict[str, dict] = {
    "tiny-moe-bench": dict(
        **_QWEN3_MOE,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=512,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "mid-moe-bench": dict(
        **_QWEN3_MOE,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=512,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "qwen3-30b-a3b": dict(
        **_QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
}
