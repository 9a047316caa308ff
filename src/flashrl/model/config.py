"""`ModelConfig`: what the engine needs from a Hugging Face `config.json`, validated.

Supported families (decoders with GQA, RoPE, RMSNorm and SwiGLU MLPs): `FAMILIES`, one `Family`
row per architecture, holds everything a family does differently (biases, q/k norm, sliding
window, refused variants, MoE layout); the decoder, the weight map and `moe_config` read those
facts instead of comparing family names. Every family reads `tie_word_embeddings`, `mlp_bias`,
`head_dim` and the RoPE fields the same way.

RoPE: `default`, `linear`, `llama3` and `yarn` scaling, read from either the transformers>=5
`rope_parameters` field or the older `rope_theta` + `rope_scaling` fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from flashrl.errors import ConfigError, UnsupportedError
from flashrl.model.moe_config import MoEConfig, MoELayout, parse_moe
from flashrl.model.remote_code import check_no_custom_code


@dataclass(frozen=True)
class Family:
    """What one model family does differently from a Llama-style dense decoder."""

    name: str
    qkv_bias: Literal["attention_bias", "always", "qkv_bias"] = "attention_bias"
    """q/k/v biases: config ``attention_bias``, always (Qwen2), or config ``qkv_bias`` (Qwen2-MoE)."""
    o_proj_bias: bool = False  # o_proj has a bias whenever q/k/v have one (Llama, Qwen3)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: bool = False  # `sliding_window` honoured (Qwen's needs use_sliding_window)
    refused: tuple[str, ...] = ()  # config flags of unimplemented variants: true is refused
    moe: MoELayout | None = None  # MoE layout and routing (`moe_config`); None: dense


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", o_proj_bias=True),
    "MistralForCausalLM": Family("mistral", sliding_window=True),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias="always", refused=("use_sliding_window",)),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, o_proj_bias=True),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe", qk_norm=True, refused=("use_sliding_window", "attention_bias"), moe="qwen"
    ),
    "Qwen2MoeForCausalLM": Family(
        "qwen2_moe", qkv_bias="qkv_bias", refused=("use_sliding_window",), moe="qwen_shared"
    ),
    "MixtralForCausalLM": Family("mixtral", sliding_window=True, moe="mixtral"),
}
"""Architecture (``config.json``'s ``architectures``) -> its family's facts."""
FAMILY_BY_NAME = {f.name: f for f in FAMILIES.values()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    moe: MoEConfig | None = None
    """Experts and routing of an MoE family (None: every MLP is dense)."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias (`Family.o_proj_bias`)."""
        facts = FAMILY_BY_NAME.get(self.family)
        return self.qkv_bias and facts is not None and facts.o_proj_bias

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read and validate a parsed config.json; `source` names the file in errors (`ConfigError`
        for bad values, `UnsupportedError` for an architecture or feature the engine lacks)."""
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source} must be a JSON object (a Hugging Face config), got {type(raw).__name__}"
            )
        check = _Checker(raw, source)
        facts = _family(check)
        family = facts.name
        vocab_size = check.int("vocab_size", MAX_VOCAB)
        hidden_size = check.int("hidden_size", MAX_DIM)
        intermediate_size = check.int("intermediate_size", MAX_DIM)
        num_layers = check.int("num_hidden_layers", MAX_LAYERS)
        num_heads = check.int("num_attention_heads", MAX_HEADS)
        num_kv_heads = check.int("num_key_value_heads", MAX_HEADS, default=num_heads)
        if num_heads % num_kv_heads:
            check.fail("num_key_value_heads", f"a divisor of num_attention_heads={num_heads}")
        head_dim = _head_dim(check, hidden_size, num_heads)
        rope_theta, rope_scaling = _rope_fields(raw, source)
        for flag in facts.refused:
            if raw.get(flag):
                raise UnsupportedError(f"{source}: {family} with {flag}=true is not supported")
        eos_ids, single_ids = _special_ids(check)
        sliding_window = None
        if facts.sliding_window and raw.get("sliding_window") is not None:
            sliding_window = check.int("sliding_window", 2**31 - 1)
        return cls(
            family=family,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=check.number(
                "rms_norm_eps", 1e-6, "a number in (0, 1)", lambda x: 0 < x < 1
            ),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=check.int("max_position_embeddings", 2**31 - 1, default=4096),
            tie_word_embeddings=check.bool("tie_word_embeddings"),
            qkv_bias=facts.qkv_bias == "always"
            or (facts.qkv_bias == "qkv_bias" and raw.get("qkv_bias", True) is not False)
            or check.bool("attention_bias"),
            mlp_bias=check.bool("mlp_bias"),
            qk_norm=facts.qk_norm,
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
            bos_token_id=single_ids["bos_token_id"],
            pad_token_id=single_ids["pad_token_id"],
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            moe=parse_moe(raw, facts.moe, num_layers, intermediate_size, source),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{path} has no config.json (expected a Hugging Face checkpoint directory)"
            )
        check_no_custom_code(path)  # before any file of the folder is interpreted
        return cls.from_dict(read_json(config_file), source=str(config_file))


MAX_VOCAB = 2**24
"""Upper bounds that catch typos and unit mistakes (a vocabulary of 1e12) before any memory is
allocated; real models are far below them (vocabularies ~256k, hidden sizes ~16k, 128 layers)."""
MAX_DIM = 2**20
MAX_LAYERS = 2**12
MAX_HEADS = 2**12
MAX_HEAD_DIM = 2**12


TOKEN_IDS_ALLOWED = "a token id (an integer >= 0), a list of them or null"


def read_json(path: Path) -> Any:
    """Parse a JSON file of a model directory; invalid JSON is a `ConfigError` naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None


def token_ids(value: Any) -> tuple[int, ...] | None:
    """`value` (null, a token id or a list of them) as a tuple of ids; None when it is anything
    else. Ids beyond the vocabulary are kept (harmless: such a token is never sampled)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(_is_int(v) and v >= 0 for v in values):
        return None
    return tuple(values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _family(check: _Checker) -> Family:
    """The model family of a supported architecture with the fields every family needs."""
    raw, source = check.raw, check.source
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        check.fail("architectures", "a list of architecture names")
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        raise UnsupportedError(
            f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(FAMILIES)}"
        )
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedError(
            f"{source}: hidden_act={raw['hidden_act']!r} is not supported; supported: silu"
        )
    return FAMILIES[arch]


def _head_dim(check: _Checker, hidden_size: int, num_heads: int) -> int:
    """``head_dim``, or hidden_size / num_attention_heads; even (RoPE rotates pairs)."""
    if check.raw.get("head_dim") is None:
        if hidden_size % num_heads:
            check.fail(
                "hidden_size", f"a multiple of num_attention_heads={num_heads} (or give head_dim)"
            )
        head_dim = hidden_size // num_heads
        if head_dim % 2:
            check.fail(
                "hidden_size",
                f"hidden_size / num_attention_heads even (RoPE pairs), not {head_dim}",
            )
        return head_dim
    head_dim = check.int("head_dim", MAX_HEAD_DIM)
    if head_dim % 2:
        check.fail("head_dim", "an even integer (RoPE rotates pairs)")
    return head_dim


def _special_ids(check: _Checker) -> tuple[tuple[int, ...], dict[str, int | None]]:
    """The EOS ids (one or a list) and the single BOS and PAD ids (or None)."""
    eos_ids = token_ids(check.raw.get("eos_token_id"))
    if eos_ids is None:
        check.fail("eos_token_id", TOKEN_IDS_ALLOWED)
    single_ids = {}
    for key in ("bos_token_id", "pad_token_id"):
        ids = token_ids(check.raw.get(key))
        if ids is None or isinstance(check.raw.get(key), list):
            check.fail(key, "a token id (an integer >= 0) or null")
        single_ids[key] = ids[0] if ids else None
    return eos_ids, single_ids


class _Checker:
    """Typed reads of config.json fields: a bad value raises a `ConfigError` naming the file, the
    key, the value and what is allowed."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def fail(self, key: str, allowed: str) -> None:
        raise ConfigError(
            f"{self.source}: {key}={self.raw.get(key)!r} is invalid; allowed: {allowed}"
        )

    def int(self, key: str, maximum: int, default: int | None = None) -> int:
        value = self.raw.get(key)
        if value is None and default is not None:
            return default
        if not _is_int(value) or not 1 <= value <= maximum:
            self.fail(key, f"an integer in [1, {maximum}]")
        return value

    def number(self, key: str, default: float, allowed: str, ok: Callable[[float], bool]) -> float:
        value = self.raw.get(key, default)
        if not _is_number(value) or not ok(value):
            self.fail(key, allowed)
        return float(value)

    def bool(self, key: str) -> bool:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, bool):
            self.fail(key, "true or false")
        return bool(value)


_ROPE_REQUIRED = {
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""The rope-scaling parameters each rope type reads (`rope_inv_freq`); all must be numbers > 0."""


def _rope_fields(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    given = raw.get(key)
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"{source}: {key}={given!r} is invalid; allowed: an object or null")
    params = dict(given or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    if not _is_number(theta) or theta <= 0:
        raise ConfigError(
            f"{source}: rope_theta={theta!r} is invalid; allowed: a finite number > 0"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedError(f"{source}: partial_rotary_factor != 1 is not supported")
    for name in _ROPE_REQUIRED.get(rope_type, ()):
        if name not in params:
            raise ConfigError(
                f"{source}: {key}: {name!r} is missing (rope type {rope_type!r} needs it)"
            )
        if not _is_number(params[name]) or params[name] <= 0:
            raise ConfigError(
                f"{source}: {key}: {name}={params[name]!r} is invalid; allowed: a finite number > 0"
            )
    return float(theta), params


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (fp32) and the attention scaling of the rope type
    (yarn's mscale; 1 otherwise). Formulas follow the Llama 3 and YaRN papers as transformers
    does."""
    dim, base, params = config.head_dim, config.rope_theta, config.rope_scaling
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = config.rope_type
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        old_len = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    original = params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(
                factor, params["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)
