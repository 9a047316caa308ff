"""Tiny random Hugging Face checkpoints, built from a config and saved locally: nothing is downloaded.

Used by the tests, `flashrl verify` and the benchmarks. Each family gets the features that make it
distinct (Qwen2: q/k/v bias; Qwen3: q/k norm and an explicit head_dim; Llama: rope scaling; Mistral:
no bias, untied head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Tiny MoE models (8 experts, top-2): Qwen3-MoE with a dense layer (`mlp_only_layers`) and
renormalised top-k, Qwen2-MoE with its shared expert, Mixtral."""


def tiny_config(family: str, **overrides: Any):
    """A `transformers` config of `family` with tiny dimensions (2 layers, hidden 64, GQA 4/2 heads)."""
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        cls = transformers.LlamaConfig
        base.update(
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    elif family == "qwen2":
        cls = transformers.Qwen2Config
        base.update(rope_theta=1000000.0, tie_word_embeddings=True)
    elif family == "qwen3":
        cls = transformers.Qwen3Config
        base.update(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True)
    elif family == "mistral":
        cls = transformers.MistralConfig
        base.update(rope_theta=10000.0, sliding_window=None)
    elif family in MOE_FAMILIES:
        cls, extra = _tiny_moe(family)
        base.update(extra)
    else:
        raise ValueError(
            f"unknown tiny model family {family!r}; allowed: {', '.join(FAMILIES + MOE_FAMILIES)}"
        )
    base.update(overrides)
    rope_scaling = base.pop("rope_scaling", None)
    config = cls(**base)
    if rope_scaling is not None:
        _set_rope_scaling(config, rope_scaling, base.get("rope_theta"))
    return config


def _tiny_moe(family: str) -> tuple[type, dict[str, Any]]:
    """Config class and MoE fields of a tiny `family` model (see `MOE_FAMILIES`)."""
    import transformers

    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig, dict(
            rope_theta=1000000.0,
            head_dim=32,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig, dict(
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        )
    return transformers.MixtralConfig, dict(
        rope_theta=10000.0, num_local_experts=8, num_experts_per_tok=2, intermediate_size=48
    )


def _set_rope_scaling(config, rope_scaling: dict, rope_theta: float | None) -> None:
    """Set rope scaling across transformers versions (4.x `rope_scaling`, 5.x `rope_parameters`)."""
    if hasattr(config, "rope_parameters"):
        params = dict(config.rope_parameters or {})
        params.update(rope_scaling)
        if rope_theta is not None:
            params["rope_theta"] = rope_theta
        config.rope_parameters = params
    else:
        config.rope_scaling = rope_scaling


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
"""Token ids 0..3 of the character tokenizer, matching the tiny configs' pad/bos/eos ids 0/1/2."""


def char_tokenizer(vocab_size: int | None = None):
    """A character-level `transformers` tokenizer built locally: ids 0-3 are the special tokens,
    then the 95 printable ASCII characters one token each, then filler tokens ``<tN>`` up to
    `vocab_size` (so every id a model can sample decodes; vLLM requires that)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in (c for c in string.printable if c.isprintable()):
        vocab.setdefault(ch, len(vocab))
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(
                f"vocab_size={vocab_size} is too small; the character tokenizer needs >= {len(vocab)}"
            )
        for i in range(len(vocab), vocab_size):
            vocab[f"<t{i}>"] = i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def save_tiny_model(
    path: str | Path,
    family: str = "qwen2",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = False,
    **overrides: Any,
) -> Path:
    """Build a random `family` model with `transformers`, save it (safetensors + config.json) to
    `path`; with `tokenizer`, also save the character tokenizer (the vocabulary must hold it)."""
    import transformers

    path = Path(path)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random-init norms are all ones; perturb them so tests notice a norm that is skipped or misapplied.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer:
        char_tokenizer(config.vocab_size).save_pretrained(path)
    return path
