"""Model dimensions for `flashrl bench --random-weights NAME` (weights drawn at random, so GPU
throughput can be measured without a checkpoint), and `random_model_dir`, which writes one as a
config.json. Dense shapes are copied from the public config.json files; MoE shapes come from
`flashrl.tools.moe_configs`.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashrl.errors import ConfigError, InputError
from flashrl.model.remote_code import check_auto_map
from flashrl.tools.moe_configs import MOE_RANDOM_CONFIGS

# Real model dimensions (from the public config.json files) for `--random-weights NAME`.
_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0)
RANDOM_CONFIGS: dict[str, dict] = {
    "tiny-bench": dict(
        **_QWEN2,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "qwen2.5-0.5b": dict(
        **_QWEN2,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        **_QWEN2,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        **_QWEN2,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
    "llama3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
RANDOM_CONFIGS.update(MOE_RANDOM_CONFIGS)  # tiny-moe-bench, mid-moe-bench, qwen3-30b-a3b
_COMMON = dict(rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=1, eos_token_id=2)


def random_model_dir(name_or_path: str, root: Path) -> Path:
    """A model directory holding only a config.json of the named dimensions (or the given file)."""
    if name_or_path in RANDOM_CONFIGS:
        raw = {**_COMMON, **RANDOM_CONFIGS[name_or_path]}
        raw["model_type"] = (
            raw.get("model_type")
            or {
                "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3",
                "LlamaForCausalLM": "llama",
            }[raw["architectures"][0]]
        )
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"--random-weights {name_or_path!r}: not a config.json file nor one "
                f"of {', '.join(RANDOM_CONFIGS)}"
            )
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"--random-weights {name_or_path}: not a JSON file ({err})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("vocab_size"), int):
            raise InputError(
                f"--random-weights {name_or_path}: expected a Hugging Face "
                f"config.json (an object with an integer vocab_size)"
            )
        check_auto_map(raw, path, f"--random-weights {name_or_path}")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    return root
