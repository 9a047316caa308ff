"""`flashrl profile` and `flashrl setup`: how much a scheme distorts a model, which layers to keep in
bf16, and a config file that applies the answer.

Needs only the bf16 checkpoint; works on every architecture the engine loads (Llama, Mistral, Qwen2,
Qwen3), because it measures the engine's own linear layers. Steps of `run_profile`:

1. Calibration data: prompts (a file, else the built-in `CALIBRATION_PROMPTS`, else, for a model
   without a tokenizer, seeded random token ids) and one response per prompt sampled by the bf16
   engine (temperature 1, seeded). The same sequences serve every scheme, so comparisons are paired.
2. Per linear layer (forward hooks on the bf16 engine, one no-cache forward over all sequences):
   for every checkpoint tensor (HF name; fused q/k/v and gate/up layers are split into their
   shards) the relative weight error ``||W - deq(Q(W))|| / ||W||`` and the relative output error
   ``||X W^T - QuantLinear(X)|| / ||X W^T||`` on the captured inputs X (fp32 outputs, bias
   included on both sides, so the bf16 output rounding is not counted).
3. End to end, per scheme: the quantized engine against the bf16 engine, by source:
   ``exact`` (the weights): next-token distributions at every position of the calibration
   sequences from no-cache forwards, compared over the full vocabulary in fp64 (no sampling noise;
   decisions use these); ``kv_cache`` (the KV cache, with ``--kv-cache-dtype fp8``):
   `Engine.kv_cache_mismatch`, the fp8 cache against an unquantized cache on the same weights,
   teacher-forced on the calibration responses; ``sampled`` (everything together): the engine
   generates its own responses through its cache, as in training, and
   `flashrl.correction.mismatch_metrics` compares its logprobs with the bf16 engine's rescoring,
   i.e. the numbers `flashrl train` logs at step 0.
4. Skip recommendation: layers whose output error exceeds `threshold` on any of their shards are
   kept in bf16 (every shard of a fused layer, since it runs as one GEMM), the engine is rebuilt
   with that skip list and step 3 is repeated. Memory: weight bytes before and after.

`DEFAULT_THRESHOLD` = 0.1 (10 % relative output error). Round-to-nearest alone gives about
0.4-1.5 % for int8 W8A8 and 1.5-4 % for the fp8 schemes on layers without outliers (measured on
tiny random and warm-started models; `down_proj`, fed by the heavy-tailed SwiGLU product, is the
worst), so 0.1 flags only layers several times worse than rounding explains: weight or activation
outliers that one scale per channel, token or tensor cannot cover.

JSON written by ``--out`` (``schema_version`` 1); `docs/profile.md` has the same table:

| field | meaning |
|---|---|
| `schema_version`, `flashrl_version`, `created` | format version (1), package version, UTC time |
| `model` | `path`, `family`, `num_layers`, `hidden_size`, `vocab_size`, `tie_word_embeddings` |
| `device`, `device_name`, `dtype` | where it ran; activation dtype of the engines |
| `settings` | `schemes`, `threshold`, `kv_cache_dtype`, `lm_head_fp32`, `seed`, `max_prompt_tokens`, `max_new_tokens`, `temperature` |
| `calibration` | `source` (`builtin`, `file`, `random_token_ids`), `file`, `num_sequences`, `prompt_tokens`, `response_tokens`, `positions`, `note` |
| `layers[]` | one entry per checkpoint linear tensor: `name` (HF), `engine_layer`, `shape` [out, in], `tokens`, `weight_amax_ratio` and `input_amax_ratio` (max / rms: outlier indicators), `errors.<scheme>.weight_error`, `errors.<scheme>.output_error` |
| `baseline.sampled` | bf16 engine's own KV-cache path vs its no-cache rescoring: the floor of the `sampled` metrics |
| `schemes.<s>.output_error_median`, `output_error_max` | over all tensors |
| `schemes.<s>.flagged[]` | `engine_layer`, `names`, `output_error` (max over its shards) of each layer above the threshold, worst first |
| `schemes.<s>.recommended_skip` | HF names to keep in bf16 (empty when nothing is flagged) |
| `schemes.<s>.skip` | the full skip list `flashrl setup` writes: `flashrl.quant.DEFAULT_SKIP` + `recommended_skip` |
| `schemes.<s>.mismatch`, `mismatch_after_skip` | `{"exact": ..., "kv_cache": ... or null, "sampled": ...}` before / after skipping (`mismatch_after_skip` is null when nothing is flagged) |
| `schemes.<s>.memory` | `weight_bytes_bf16`, `weight_bytes`, `weight_bytes_after_skip`, `ratio`, `ratio_after_skip` |
| `kv_cache` | null for a bf16 KV cache; for fp8: `dtype`, `kv_scale`, `bytes_per_token_bf16`, `bytes_per_token`, `kv_only` (`kv_cache` and `sampled` of bf16 weights with the fp8 cache) |

`exact` fields (means over positions; q = quantized engine, p = bf16 engine): `kl` = KL(q || p),
the expectation of the correction module's `kl` and `k3_kl` when the rollout samples from q;
`kl_max` (worst position); `reverse_kl` = KL(p || q); `tv` (total variation);
`rollout_probs_diff_max` = max over positions and tokens of |q - p|, an upper bound of the
correction metric of that name; `rollout_probs_diff_mean` = E over tokens drawn from q of
|q - p|; `top1_agreement` (fraction of positions with the same argmax); `positions`.
`kv_cache` fields (`Engine.kv_cache_mismatch`, over response tokens): `kl`, `kl_max` (exact
KL(fp8 cache || unquantized cache)), `k3_kl`, `logprob_abs_diff_max`, `logit_abs_diff_max`, `tokens`.
`sampled` fields: those of `flashrl.correction.mismatch_metrics` (`kl`, `k3_kl`,
`rollout_probs_diff_max`, ...) plus `tokens`.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import flashrl
from flashrl.calibration_prompts import CALIBRATION_PROMPTS
from flashrl.config import KV_CACHE_DTYPES, RolloutConfig
from flashrl.correction import mismatch_metrics
from flashrl.model.decoder import GATE_UP_SHARDS, QKV_SHARDS
from flashrl.model.config import ModelConfig
from flashrl.engine.sampler import SamplingParams
from flashrl.errors import ConfigError, InputError, UnsupportedError
from flashrl.fileio import atomic_write_text
from flashrl.quant.linear import DEFAULT_SKIP, DenseLinear, QuantLinear
from flashrl.quant.schemes import SCHEMES, parse_scheme_list
from flashrl.utils import device_name, format_table

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_THRESHOLD = 0.1
"""Relative output error above which a layer is recommended to stay in bf16 (see module doc)."""
_FUSED_SHARDS = {"qkv_proj": QKV_SHARDS, "gate_up_proj": GATE_UP_SHARDS}
_RANDOM_PROMPTS = 16
_MAX_BATCH = 16
MAX_TABLE_LAYERS = 40
"""The stdout table lists at most this many tensors (the worst); the JSON has all."""


@dataclass
class ProfileConfig:
    """Arguments of `run_profile` (the CLI flags of `flashrl profile`)."""

    model: str
    quant: str | Sequence[str] = "int8"
    """Schemes to profile: a comma-separated string or a list (bf16 is always the reference)."""
    prompts: str | None = None
    """A prompts file (.txt: one per line; .jsonl: strings or objects with "prompt" or "text")."""
    kv_cache_dtype: str = "bf16"
    threshold: float = DEFAULT_THRESHOLD
    max_prompt_tokens: int = 128
    max_new_tokens: int = 64
    device: str | None = None
    dtype: str = "bf16"
    lm_head_fp32: bool = False
    seed: int = 0
    temperature: float = 1.0

    def schemes(self) -> list[str]:
        text = self.quant if isinstance(self.quant, str) else ",".join(self.quant)
        names = [s.name for s in parse_scheme_list(text)]
        if "bf16" in names:
            raise ConfigError(f"--quant {text!r}: bf16 is the reference every scheme is compared with; "
                              f"list quantized schemes only ({', '.join(s for s in SCHEMES if s != 'bf16')})")
        if len(set(names)) != len(names):
            raise ConfigError(f"--quant {text!r} names a scheme twice")
        return names

    def check(self) -> None:
        self.schemes()
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold > 0):
            raise ConfigError(f"--threshold {self.threshold!r} is invalid; allowed: a positive number "
                              f"(relative output error, default {DEFAULT_THRESHOLD})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is invalid; "
                              f"allowed: {', '.join(KV_CACHE_DTYPES)}")
        for name in ("max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0 (responses are sampled)")
        if self.prompts is not None:
            read_prompts_file(self.prompts)  # a bad file fails before any model is loaded


# ------------------------------------------------------------------------------------------------
# engines and calibration data
# ------------------------------------------------------------------------------------------------


def kv_cache_dtype_supported() -> bool:
    """Whether this build's `Engine` takes ``kv_cache_dtype`` (the fp8 KV cache)."""
    from flashrl.engine.engine import Engine

    return "kv_cache_dtype" in inspect.signature(Engine).parameters and hasattr(Engine, "kv_cache_mismatch")


def _engine(cfg: ProfileConfig, quant: str, skip: Sequence[str], max_len: int, kv_cache_dtype: str = "bf16"):
    from flashrl.engine.engine import Engine

    config = RolloutConfig(quant=quant, skip=tuple(skip), lm_head_fp32=cfg.lm_head_fp32, kv_cache_dtype=kv_cache_dtype)
    return Engine(cfg.model, quant=config, dtype=cfg.dtype, device=cfg.device, max_batch=_MAX_BATCH,
                  max_len=max_len, seed=cfg.seed, progress=False)


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a .jsonl file (JSON strings or objects with "prompt" / "text") or a text file
    (one prompt per non-empty line). Errors name the file and line."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"--prompts: {str(path)!r} is a directory; expected a .txt or .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"--prompts: file {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte {err.start})") from None
    prompts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix.lower() == ".jsonl":
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if isinstance(item, dict):
                item = item.get("prompt", item.get("text"))
            if not isinstance(item, str) or not item:
                raise InputError(f'{path}:{number}: expected a JSON string or an object with a "prompt" or '
                                 f'"text" string')
            prompts.append(item)
        else:
            prompts.append(line)
    if not prompts:
        raise InputError(f"{path}: no prompts found")
    return prompts


def calibration_prompts(cfg: ProfileConfig, engine, max_prompt_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Token ids of the calibration prompts and a description for the JSON."""
    info: dict[str, Any] = {"source": "builtin", "file": None, "note": None}
    if engine.tokenizer is None:
        if cfg.prompts is not None:
            raise ConfigError(f"--prompts {cfg.prompts}: {cfg.model} has no tokenizer, so text prompts cannot be "
                              f"encoded")
        gen = torch.Generator().manual_seed(cfg.seed)
        vocab = engine.model_config.vocab_size
        lengths = torch.randint(max(1, max_prompt_tokens // 4), max_prompt_tokens + 1, (_RANDOM_PROMPTS,), generator=gen)
        ids = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]
        info.update(source="random_token_ids",
                    note=f"the model has no tokenizer: {_RANDOM_PROMPTS} prompts of seeded random token ids (seed {cfg.seed})")
        return ids, info
    texts = list(CALIBRATION_PROMPTS)
    if cfg.prompts is not None:
        texts = read_prompts_file(cfg.prompts)
        info.update(source="file", file=str(cfg.prompts))
    ids = [engine.tokenizer(t, add_special_tokens=True)["input_ids"][:max_prompt_tokens] for t in texts]
    ids = [p for p in ids if p]
    if not ids:
        raise InputError("every calibration prompt encodes to zero tokens")
    return ids, info


# ------------------------------------------------------------------------------------------------
# per-layer errors
# ------------------------------------------------------------------------------------------------


def shard_names(engine_name: str, num_shards: int) -> list[str]:
    """HF checkpoint names of an engine layer's shards: layers.0.self_attn.qkv_proj ->
    model.layers.0.self_attn.{q,k,v}_proj."""
    parent, _, leaf = engine_name.rpartition(".")
    parts = _FUSED_SHARDS.get(leaf, (leaf,))
    if len(parts) != num_shards:
        raise ValueError(f"engine layer {engine_name} has {num_shards} shard(s); expected {len(parts)}")
    return [f"model.{parent}.{p}" for p in parts]


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.double().norm())
    return float(diff.double().norm()) / denom if denom > 0 else (0.0 if float(diff.double().norm()) == 0 else math.inf)


def _amax_ratio(t: torch.Tensor) -> float:
    t = t.double()
    rms = float(t.pow(2).mean().sqrt())
    return float(t.abs().max()) / rms if rms > 0 else 0.0


@torch.no_grad()
def layer_errors(engine, sequences: list[list[int]], schemes: Sequence[str]) -> list[dict[str, Any]]:
    """Per checkpoint tensor: weight and output errors of every scheme on the inputs the bf16
    `engine` sees over `sequences` (one batched no-cache forward, right-padded; padding rows are
    dropped)."""
    from flashrl.model.batch import ForwardBatch

    layers = [(name, m) for name, m in engine.model.named_modules()
              if isinstance(m, DenseLinear) and name.startswith("layers.")]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        valid[row, : len(seq)] = True
    valid = valid.flatten().to(engine.device)
    rows: list[dict[str, Any]] = []

    def hook(name: str):
        def fn(module: DenseLinear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, module.in_features)[valid]
            w = module.weight.float()
            y_ref = x.float() @ w.t()
            if module.bias is not None:
                y_ref += module.bias.float()
            names = shard_names(name, len(module.shard_sizes))
            entries = []
            for i, hf_name in enumerate(names):
                start, end = module.shard_rows(i)
                entries.append({"name": hf_name, "engine_layer": f"model.{name}", "shape": [end - start, module.in_features],
                                "tokens": int(x.shape[0]), "weight_amax_ratio": _amax_ratio(w[start:end]),
                                "input_amax_ratio": _amax_ratio(x), "errors": {}})
            for scheme in schemes:
                q = QuantLinear.from_linear(module, scheme, shard_sizes=module.shard_sizes)
                w_deq = q.dequantized_weight(torch.float32)
                try:
                    y_q = q(x.float())  # fp32 output: the bf16 output rounding is not quantization error
                except RuntimeError:
                    if x.device.type != "cuda":
                        raise
                    # Some CUDA fp8 kernels only produce bf16: measured with that rounding (about 0.2 %).
                    logger.warning("profile: %s on %s: fp32 output refused by the GEMM; measuring with bf16 output",
                                   scheme, name)
                    y_q = q(x.to(module.weight.dtype)).float()
                for i, entry in enumerate(entries):
                    start, end = module.shard_rows(i)
                    entry["errors"][scheme] = {
                        "weight_error": _rel(w_deq[start:end] - w[start:end], w[start:end]),
                        "output_error": _rel(y_q[:, start:end] - y_ref[:, start:end], y_ref[:, start:end]),
                    }
                del q, w_deq, y_q
            rows.extend(entries)

        return fn

    handles = [m.register_forward_hook(hook(name)) for name, m in layers]
    try:
        positions = torch.arange(width, device=engine.device).expand(len(sequences), width)
        engine.model.hidden_states(ids.to(engine.device), ForwardBatch(positions=positions))
    finally:
        for h in handles:
            h.remove()
    return rows


def recommend_skip(layers: list[dict[str, Any]], scheme: str, threshold: float) -> list[dict[str, Any]]:
    """Engine layers with a shard whose output error exceeds `threshold`, worst first: each with
    its `engine_layer`, all shard `names` and the max `output_error`."""
    flagged: dict[str, dict[str, Any]] = {}
    for entry in layers:
        err = entry["errors"][scheme]["output_error"]
        item = flagged.setdefault(entry["engine_layer"], {"engine_layer": entry["engine_layer"], "names": [],
                                                          "output_error": 0.0})
        item["names"].append(entry["name"])
        item["output_error"] = max(item["output_error"], err)
    chosen = [f for f in flagged.values() if f["output_error"] > threshold]
    return sorted(chosen, key=lambda f: -f["output_error"])


# ------------------------------------------------------------------------------------------------
# end-to-end mismatch
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def distribution_mismatch(reference, engine, sequences: list[list[int]], temperature: float = 1.0) -> dict[str, float]:
    """Full-vocabulary comparison in fp64 of `engine` (q) with `reference` (p) at every position of
    `sequences` (no-cache forwards); fields as in the module doc's ``exact``."""
    sums = dict(kl=0.0, reverse_kl=0.0, tv=0.0, rollout_probs_diff_mean=0.0, top1_agreement=0.0)
    kl_max = diff_max = 0.0
    positions = 0
    for seq in sequences:
        lp = torch.log_softmax(reference.logits(seq).double() / temperature, dim=-1)
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
    return {k: out[k] for k in ("kl", "kl_max", "reverse_kl", "tv", "rollout_probs_diff_max",
                                "rollout_probs_diff_mean", "top1_agreement", "positions")}


@torch.no_grad()
def sampled_mismatch(reference, rollouts, temperature: float = 1.0) -> dict[str, float]:
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
        lp_train[i, :n] = torch.tensor(reference.score(r.prompt_ids, r.response_ids, temperature=temperature))
        mask[i, :n] = True
    metrics = mismatch_metrics(lp_train, lp_roll, mask)
    metrics["tokens"] = int(mask.sum())
    return metrics


def _sampling(cfg: ProfileConfig, max_new: int) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, max_tokens=max_new, seed=cfg.seed)


def _free() -> None:
    """Release the memory of engines the caller dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# the profile
# ------------------------------------------------------------------------------------------------


def run_profile(cfg: ProfileConfig) -> dict[str, Any]:
    """Profile `cfg.model` for every scheme of `cfg.quant`; returns the JSON document (module doc)."""
    from flashrl.verify import scheme_unsupported_reason

    cfg.check()
    schemes = cfg.schemes()
    model_config = ModelConfig.from_model_dir(cfg.model)  # clear errors for a missing or bad directory
    if cfg.kv_cache_dtype != "bf16" and not kv_cache_dtype_supported():
        raise UnsupportedError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: the fp8 KV cache is not available in this "
                               f"build of flashrl (Engine has no kv_cache_dtype argument or no kv_cache_mismatch); "
                               f"profile without it")
    # Prompt and response budgets within the model's context.
    max_new = min(cfg.max_new_tokens, max(1, model_config.max_position_embeddings // 2))
    max_prompt = min(cfg.max_prompt_tokens, model_config.max_position_embeddings - max_new)
    max_len = max_prompt + max_new

    reference = _engine(cfg, "bf16", DEFAULT_SKIP, max_len)
    device = reference.device
    for scheme in schemes:
        reason = scheme_unsupported_reason(scheme, device)
        if reason:
            raise UnsupportedError(f"--quant {scheme}: cannot run on {device}: {reason}")
    prompts, calibration = calibration_prompts(cfg, reference, max_prompt)
    params = _sampling(cfg, max_new)
    logger.info("profile: sampling %d bf16 responses", len(prompts))
    base_rollouts = reference.generate(prompts, params)
    sequences = [r.prompt_ids + r.response_ids for r in base_rollouts]
    calibration.update(num_sequences=len(sequences), prompt_tokens=sum(len(p) for p in prompts),
                       response_tokens=sum(len(r.response_ids) for r in base_rollouts),
                       positions=sum(len(s) for s in sequences))
    logger.info("profile: per-layer errors over %d tokens", calibration["positions"])
    layers = layer_errors(reference, sequences, schemes)
    bf16_bytes = reference.weight_nbytes()

    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "flashrl_version": flashrl.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"path": str(Path(cfg.model).resolve()), "family": model_config.family,
                  "num_layers": model_config.num_layers, "hidden_size": model_config.hidden_size,
                  "vocab_size": model_config.vocab_size, "tie_word_embeddings": model_config.tie_word_embeddings},
        "device": str(device), "device_name": device_name(device), "dtype": cfg.dtype,
        "settings": {"schemes": schemes, "threshold": float(cfg.threshold), "kv_cache_dtype": cfg.kv_cache_dtype,
                     "lm_head_fp32": cfg.lm_head_fp32, "seed": cfg.seed, "max_prompt_tokens": max_prompt,
                     "max_new_tokens": max_new, "temperature": cfg.temperature},
        "calibration": calibration,
        "layers": layers,
        "baseline": {"sampled": sampled_mismatch(reference, base_rollouts, cfg.temperature)},
        "schemes": {},
        "kv_cache": None,
    }
    kv = cfg.kv_cache_dtype
    pairs = ([r.prompt_ids for r in base_rollouts if r.response_ids], [r.response_ids for r in base_rollouts if r.response_ids])

    def mismatch(engine) -> dict[str, Any]:
        out = {"exact": distribution_mismatch(reference, engine, sequences, cfg.temperature),
               "sampled": sampled_mismatch(reference, engine.generate(prompts, params), cfg.temperature),
               "kv_cache": None}
        if kv != "bf16":
            out["kv_cache"] = engine.kv_cache_mismatch(*pairs, temperature=cfg.temperature)
        return out

    for scheme in schemes:
        logger.info("profile: %s end to end", scheme)
        errors = [entry["errors"][scheme]["output_error"] for entry in layers]
        flagged = recommend_skip(layers, scheme, cfg.threshold)
        recommended = [name for f in flagged for name in f["names"]]
        skip = list(DEFAULT_SKIP) + recommended
        engine = _engine(cfg, scheme, DEFAULT_SKIP, max_len, kv)
        entry: dict[str, Any] = {
            "output_error_median": float(torch.tensor(errors).median()), "output_error_max": max(errors),
            "flagged": flagged, "recommended_skip": recommended, "skip": skip,
            "mismatch": mismatch(engine), "mismatch_after_skip": None,
            "memory": {"weight_bytes_bf16": bf16_bytes, "weight_bytes": engine.weight_nbytes(),
                       "weight_bytes_after_skip": None},
        }
        engine = None
        _free()
        if recommended:
            engine = _engine(cfg, scheme, skip, max_len, kv)
            entry["mismatch_after_skip"] = mismatch(engine)
            entry["memory"]["weight_bytes_after_skip"] = engine.weight_nbytes()
            engine = None
            _free()
        else:
            entry["memory"]["weight_bytes_after_skip"] = entry["memory"]["weight_bytes"]
        memory = entry["memory"]
        memory["ratio"] = memory["weight_bytes"] / bf16_bytes
        memory["ratio_after_skip"] = memory["weight_bytes_after_skip"] / bf16_bytes
        result["schemes"][scheme] = entry
    if kv != "bf16":
        engine = _engine(cfg, "bf16", DEFAULT_SKIP, max_len, kv)
        kv_only = mismatch(engine)
        del kv_only["exact"]  # bf16 weights: the no-cache forward is the reference itself
        result["kv_cache"] = {"dtype": kv, "kv_scale": engine.config.kv_scale,
                              "bytes_per_token_bf16": reference.kv_bytes_per_token(),
                              "bytes_per_token": engine.kv_bytes_per_token(), "kv_only": kv_only}
        engine = None
        _free()
    return _finite(result)


def _finite(value: Any) -> Any:
    """Replace NaN / inf floats by None, so the file is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_profile(result: dict[str, Any], path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps(result, indent=2, allow_nan=False) + "\n")


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}" if value != 0 else "0"


def format_profile(result: dict[str, Any]) -> str:
    """The readable summary printed by `flashrl profile`."""
    settings, schemes = result["settings"], result["settings"]["schemes"]
    threshold = settings["threshold"]
    lines = [f"model {result['model']['path']} ({result['model']['family']}, {result['model']['num_layers']} layers) "
             f"on {result['device_name']}; calibration: {result['calibration']['source']}, "
             f"{result['calibration']['num_sequences']} sequences, {result['calibration']['positions']} positions"]
    if result["calibration"].get("note"):
        lines.append(f"note: {result['calibration']['note']}")
    lines.append("")
    layers = result["layers"]
    if len(layers) > MAX_TABLE_LAYERS:
        worst = sorted(layers, key=lambda e: -max(e["errors"][s]["output_error"] for s in schemes))[:MAX_TABLE_LAYERS]
        keep = {id(e) for e in worst}
        layers = [e for e in layers if id(e) in keep]
        lines.append(f"per-layer relative errors of the {MAX_TABLE_LAYERS} worst of {len(result['layers'])} tensors "
                     f"(all in the JSON; * = output error above the threshold {threshold:g})")
    else:
        lines.append(f"per-layer relative errors (* = output error above the threshold {threshold:g})")
    rows = []
    for entry in layers:
        row = {"layer": entry["name"], "shape": "x".join(map(str, entry["shape"])),
               "w amax/rms": f"{entry['weight_amax_ratio']:.1f}"}
        for s in schemes:
            e = entry["errors"][s]
            row[f"{s} weight"] = _fmt(e["weight_error"])
            row[f"{s} output"] = _fmt(e["output_error"]) + (" *" if e["output_error"] > threshold else "")
        rows.append(row)
    columns = ["layer", "shape", "w amax/rms"] + [f"{s} {k}" for s in schemes for k in ("weight", "output")]
    lines.append(format_table(rows, columns))
    lines.append("")
    lines.append("end to end vs the bf16 engine. kl, kl max, probs diff max, top1 agree: weights only, exact over "
                 "the full vocabulary at every calibration position")
    lines.append("(no-cache forwards); kv kl: the KV cache only, exact, teacher-forced; sampled *: everything, on "
                 "the config's own rollouts (what training logs at step 0)")
    e2e = []

    def add(label: str, mismatch: dict[str, Any], weight_bytes: int | None) -> None:
        exact, sampled, kv = mismatch.get("exact") or {}, mismatch["sampled"], mismatch.get("kv_cache") or {}
        e2e.append({"config": label, "kv kl": _fmt(kv.get("kl")) if kv else "-", "kl": _fmt(exact.get("kl")) if exact else "-",
                    "kl max": _fmt(exact.get("kl_max")) if exact else "-",
                    "probs diff max": _fmt(exact.get("rollout_probs_diff_max")) if exact else "-",
                    "top1 agree": _fmt(exact.get("top1_agreement"), 4) if exact else "-",
                    "sampled kl": _fmt(sampled.get("kl")), "sampled k3_kl": _fmt(sampled.get("k3_kl")),
                    "sampled probs diff max": _fmt(sampled.get("rollout_probs_diff_max")),
                    "weights MiB": f"{weight_bytes / 2**20:.2f}" if weight_bytes else ""})

    add("bf16 (floor: cached vs no-cache)", {"sampled": result["baseline"]["sampled"]},
        next(iter(result["schemes"].values()))["memory"]["weight_bytes_bf16"] if result["schemes"] else None)
    for s in schemes:
        entry = result["schemes"][s]
        add(s, entry["mismatch"], entry["memory"]["weight_bytes"])
        if entry["mismatch_after_skip"] is not None:
            add(f"{s} + skip {len(entry['flagged'])} layer(s)", entry["mismatch_after_skip"],
                entry["memory"]["weight_bytes_after_skip"])
    if result.get("kv_cache"):
        add(f"bf16 weights + {result['kv_cache']['dtype']} KV", result["kv_cache"]["kv_only"], None)
    columns = ["config", "kl", "kl max", "probs diff max", "top1 agree"] + (["kv kl"] if result.get("kv_cache") else [])
    lines.append(format_table(e2e, columns + ["sampled kl", "sampled k3_kl", "sampled probs diff max", "weights MiB"]))
    if result.get("kv_cache"):
        kv = result["kv_cache"]
        lines.append(f"KV cache {kv['dtype']} (scales: {kv['kv_scale']}): {kv['bytes_per_token']} bytes per token, "
                     f"{kv['bytes_per_token_bf16']} in bf16")
    lines.append("")
    for s in schemes:
        entry = result["schemes"][s]
        if entry["flagged"]:
            worst = ", ".join(f"{f['engine_layer']} ({f['output_error']:.3g})" for f in entry["flagged"])
            lines.append(f"{s}: keep {len(entry['flagged'])} layer(s) in bf16: {worst}")
        else:
            lines.append(f"{s}: no layer above the threshold; max output error {entry['output_error_max']:.3g}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# setup
# ------------------------------------------------------------------------------------------------


def _require(doc: Any, path: str, source: str, kind: type | tuple[type, ...]) -> Any:
    value = doc
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise InputError(f"{source}: missing field {path!r}; is this a file written by `flashrl profile`?")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float, (int, float)):
        raise InputError(f"{source}: field {path!r} has type {type(value).__name__}; expected "
                         f"{kind.__name__ if isinstance(kind, type) else ' or '.join(k.__name__ for k in kind)}")
    return value


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and validate a profile JSON; errors name the file and the field."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"--profile: {str(path)!r} is a directory; expected a JSON file written by `flashrl profile`")
    if not path.is_file():
        raise FileNotFoundError(f"--profile: file {str(path)!r} does not exist")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a JSON file ({err})") from None
    source = str(path)
    version = _require(doc, "schema_version", source, int)
    if version != SCHEMA_VERSION:
        raise InputError(f"{source}: schema_version {version} is not supported by this flashrl "
                         f"(reads {SCHEMA_VERSION}); re-run `flashrl profile`")
    schemes = _require(doc, "settings.schemes", source, list)
    _require(doc, "settings.kv_cache_dtype", source, str)
    _require(doc, "settings.lm_head_fp32", source, bool)
    _require(doc, "settings.threshold", source, (int, float))
    _require(doc, "layers", source, list)
    for s in schemes:
        if s not in SCHEMES:
            raise InputError(f"{source}: settings.schemes names unknown scheme {s!r}; allowed: {', '.join(SCHEMES)}")
        _require(doc, f"schemes.{s}.skip", source, list)
        _require(doc, f"schemes.{s}.mismatch", source, dict)
    for i, entry in enumerate(doc["layers"]):
        for s in schemes:
            _require(entry, f"errors.{s}.output_error", f"{source}: layers[{i}]", (int, float))
        _require(entry, "name", f"{source}: layers[{i}]", str)
        _require(entry, "engine_layer", f"{source}: layers[{i}]", str)
    return doc


def build_setup(profile: dict[str, Any], quant: str | None = None, threshold: float | None = None,
                source: str = "profile") -> tuple[RolloutConfig, str]:
    """The `RolloutConfig` for one profiled scheme and the header comment describing it.

    `quant` picks among the profiled schemes (required when several were profiled); `threshold`
    re-derives the skip list from the per-layer errors (the profile's end-to-end numbers then
    describe its own threshold, which the header says)."""
    schemes = profile["settings"]["schemes"]
    if quant is None:
        if len(schemes) != 1:
            raise ConfigError(f"{source} profiles {len(schemes)} schemes ({', '.join(schemes)}); "
                              f"choose one with --quant")
        quant = schemes[0]
    quant = quant.strip().lower()
    if quant not in schemes:
        raise ConfigError(f"--quant {quant!r} was not profiled in {source}; allowed: {', '.join(schemes)}")
    entry = profile["schemes"][quant]
    skip, used = list(entry["skip"]), profile["settings"]["threshold"]
    if threshold is not None:
        if not (math.isfinite(threshold) and threshold > 0):
            raise ConfigError(f"--threshold {threshold!r} is invalid; allowed: a positive number")
        skip = list(DEFAULT_SKIP) + [n for f in recommend_skip(profile["layers"], quant, threshold) for n in f["names"]]
    kv = profile["settings"]["kv_cache_dtype"]
    try:
        config = RolloutConfig(quant=quant, skip=tuple(skip), kv_cache_dtype=kv, kv_scale="calibrated",
                               lm_head_fp32=profile["settings"]["lm_head_fp32"], logprobs_mode="processed")
    except ConfigError as err:
        raise InputError(f"{source}: schemes.{quant}: {err}") from None
    before = entry["mismatch"]["exact"]["kl"] if entry["mismatch"].get("exact") else None
    after = (entry["mismatch_after_skip"] or entry["mismatch"])["exact"]["kl"] if entry["mismatch"].get("exact") else None
    kept = len(skip) - len(DEFAULT_SKIP)
    lines = [
        f"flashrl rollout config written by `flashrl setup` (flashrl {flashrl.__version__}) from {source}",
        f"model: {profile.get('model', {}).get('path', '?')}; profiled {profile.get('created', '?')} on {profile.get('device_name', '?')}",
        f"scheme {quant}; {kept} checkpoint tensor(s) kept in bf16 besides the defaults ({', '.join(DEFAULT_SKIP)})",
    ]
    if threshold is None or threshold == used:
        lines.append(f"threshold {used:g} (relative output error); exact KL(quant || bf16) per position: "
                     f"{_fmt(before)} with all layers quantized, {_fmt(after)} with this skip list")
    else:
        lines.append(f"threshold {threshold:g} chosen at setup (the profile used {used:g}): the mismatch of this "
                     f"skip list was not measured; re-run `flashrl profile --threshold {threshold:g}` to measure it")
    lines += ["use: FLASHRL_CONFIG=<this file>, Engine(model, quant=<this file>), flashrl generate --quant <this file>,",
              "     or rollout_config: <this file> in a `flashrl train` config"]
    return config, "\n".join(lines)


def run_setup(profile_path: str | Path, out: str | Path, quant: str | None = None,
              threshold: float | None = None) -> RolloutConfig:
    """Read a profile, write the YAML config for one scheme to `out`, and return the config."""
    profile = load_profile(profile_path)
    config, header = build_setup(profile, quant, threshold, source=str(profile_path))
    out = Path(out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {str(out.parent)!r} does not exist")
    config.to_yaml(out, header=header)
    if RolloutConfig.from_yaml(out) != config:  # the file must read back to the same config
        raise RuntimeError(f"{out} does not read back to the config it was written from")
    return config
