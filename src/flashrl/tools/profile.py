"""`flashrl profile`: how much a scheme distorts a model and which layers to keep in bf16
(`flashrl setup` then writes a config file that applies the answer).

Needs only the bf16 checkpoint; works on every architecture the engine loads (Llama, Mistral, Qwen2,
Qwen3, and the MoE families, per expert: `flashrl.tools.profile_experts`), because it measures the
engine's own linear layers. Steps of `run_profile`:

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
   teacher-forced on the calibration responses, once per scheme on the recommended config (two
   teacher-forced passes cost as much as two generates); ``sampled`` (everything together): the engine
   generates its own responses through its cache, as in training, and
   `flashrl.correction.mismatch_metrics` compares its logprobs with the bf16 engine's rescoring,
   i.e. the numbers `flashrl train` logs at step 0.
4. Skip recommendation: layers whose output error exceeds `threshold` on any of their shards are
   candidates (every shard of a fused layer together, since it runs as one GEMM); each is kept in
   bf16 only if that lowers the exact end-to-end KL (`flashrl.tools.profile_select`: worst first,
   on top of those already chosen), so the recommendation never raises the KL it was measured on.
   The engine is rebuilt with the chosen skip list and step 3 is repeated. Memory: weight bytes
   before and after.
5. Smoothing (`--smooth`, default 0.5; dense models): online smoothing (`rollout.smooth`) on top of
   the chosen skip list, decided on the exact KL alone (its engine calibrates on the calibration
   prompts, as its first rollout would) and measured in full as in step 3 only when it lowers that
   KL; `flashrl setup` writes it as ``smooth``.

`DEFAULT_THRESHOLD` = 0.1 (10 % relative output error). Round-to-nearest alone gives about
0.4-1.5 % for int8 W8A8 and 1.5-4 % for the fp8 schemes on layers without outliers (measured on
tiny random and warm-started models; `down_proj`, fed by the heavy-tailed SwiGLU product, is the
worst), so 0.1 flags only layers several times worse than rounding explains: weight or activation
outliers that one scale per channel, token or tensor cannot cover.

The JSON document (``schema_version`` 1, `ProfileResult.to_dict`) is described field by field in
docs/profile.md. Modules: this one runs the profile, `flashrl.tools.profile_metrics` measures,
`flashrl.tools.profile_report` prints the table, `flashrl.tools.setup` turns a profile into a
rollout config.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from pathlib import Path
from typing import Any

import torch

import flashrl
from flashrl.engine import Engine
from flashrl.fileio import atomic_write_text
from flashrl.model.config import ModelConfig
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.tools.profile_config import DEFAULT_THRESHOLD, ProfileConfig
from flashrl.tools.profile_engines import Calibration, Stages, calibrate, free_memory, make_engine
from flashrl.tools.profile_metrics import layer_errors, recommend_skip, sampled_mismatch
from flashrl.tools.profile_schema import (
    KVCacheProfile,
    ModelSummary,
    ProfileResult,
    ProfileSettings,
    SchemeProfile,
    WeightMemory,
)
from flashrl.tools.profile_select import select_skips
from flashrl.utils import device_name

__all__ = ["DEFAULT_THRESHOLD", "SCHEMA_VERSION", "ProfileConfig", "run_profile", "write_profile"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


def _scheme_entry(
    cal: Calibration, scheme: str, layers: list[dict[str, Any]], bf16_bytes: int, stage: Stages
) -> SchemeProfile:
    """``schemes.<scheme>`` of the document: errors, the skip recommendation, the mismatch before
    and after skipping and smoothing, memory; the KV cache measured on the recommended config."""
    cfg, kv = cal.cfg, cal.cfg.kv_cache_dtype
    logger.info("profile: %s end to end", scheme)
    errors = [entry["errors"][scheme]["output_error"] for entry in layers]
    flagged = recommend_skip(layers, scheme, cfg.threshold)
    with stage(f"{scheme} end to end"):
        engine = make_engine(cfg, scheme, DEFAULT_SKIP, cal.max_len, kv)
        weight_bytes = engine.weight_nbytes()
        mismatch = cal.mismatch(engine)
        engine = None
        free_memory()

    with stage(f"{scheme} skip list ({len(flagged)} candidate(s))"):
        recommended, tried, after_skip, bytes_after_skip = _skip_list(
            cal, scheme, flagged, mismatch
        )
    skip = list(DEFAULT_SKIP) + recommended
    with stage(f"{scheme} smoothing"):
        best = (after_skip or mismatch)["exact"]
        smoothing, after_smooth, engine = _smoothing_trial(cal, scheme, skip, best)
    if kv != "bf16":
        with stage(f"{scheme} + {kv} KV cache"):
            engine = engine or make_engine(cfg, scheme, skip, cal.max_len, kv)
            (after_smooth or after_skip or mismatch)["kv_cache"] = cal.kv_cache(engine)
    engine = None
    free_memory()
    return SchemeProfile(
        smoothing=smoothing,
        recommended_smooth=smoothing["alpha"] if smoothing and smoothing["kept"] else None,
        mismatch_after_smooth=after_smooth,
        output_error_median=float(torch.tensor(errors).median()),
        output_error_max=max(errors),
        flagged=flagged,
        skip_trials=tried,
        recommended_skip=recommended,
        skip=skip,
        mismatch=mismatch,
        mismatch_after_skip=after_skip,
        memory=WeightMemory(
            weight_bytes_bf16=bf16_bytes,
            weight_bytes=weight_bytes,
            weight_bytes_after_skip=bytes_after_skip or weight_bytes,
            ratio=weight_bytes / bf16_bytes,
            ratio_after_skip=(bytes_after_skip or weight_bytes) / bf16_bytes,
        ),
    )


def _skip_list(
    cal: Calibration, scheme: str, flagged: list[str], mismatch: dict[str, Any]
) -> tuple[list[str], list[dict[str, Any]], dict[str, Any] | None, int | None]:
    """The flagged layers worth keeping in bf16 (`profile_select.select_skips` on the exact KL), the
    trials, and the mismatch and weight bytes with them (None when none is kept)."""
    cfg, kv = cal.cfg, cal.cfg.kv_cache_dtype

    def kl_of(names: list[str]) -> float:  # exact end-to-end KL with `names` kept in bf16
        trial = make_engine(cfg, scheme, list(DEFAULT_SKIP) + names, cal.max_len, kv)
        kl = cal.exact(trial)["kl"]
        free_memory()
        return kl

    recommended, tried = select_skips(
        flagged, kl_of, mismatch["exact"]["kl"], progress=cfg.progress
    )
    if not recommended:
        return recommended, tried, None, None
    engine = make_engine(cfg, scheme, list(DEFAULT_SKIP) + recommended, cal.max_len, kv)
    after_skip, nbytes = cal.mismatch(engine), engine.weight_nbytes()
    engine = None
    free_memory()
    return recommended, tried, after_skip, nbytes


def _smoothing_trial(
    cal: Calibration, scheme: str, skip: list[str], best: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, Engine | None]:
    """``smoothing`` of a scheme: online smoothing (`cfg.smooth`) on top of the chosen skip list,
    kept only if it lowers the exact KL `best`. It is decided on the exact KL alone (the engine
    calibrates on the calibration prompts, as its first rollout would, by a one-token generate);
    a kept trial is then measured in full and its engine returned for the KV-cache measurement."""
    alpha = cal.cfg.smooth
    if alpha is None:
        return None, None, None
    if cal.reference.model_config.moe is not None:
        reason = "MoE experts are not smoothed"
        return {"alpha": alpha, "kl": None, "kept": False, "reason": reason}, None, None
    engine = make_engine(cal.cfg, scheme, skip, cal.max_len, cal.cfg.kv_cache_dtype, smooth=alpha)
    engine.generate(cal.prompts, dataclasses.replace(cal.params, max_tokens=1))
    exact = cal.exact(engine)
    trial = {"alpha": alpha, "kl": exact["kl"], "kept": exact["kl"] < best["kl"], "reason": None}
    if not trial["kept"]:
        return trial, None, None
    return trial, cal.mismatch(engine, exact=exact), engine


def _kv_cache_entry(cal: Calibration) -> KVCacheProfile:
    """``kv_cache`` of the document: bf16 weights with the quantized KV cache, teacher-forced only
    (no sampled rollouts: a generate would add a third decode pass to the two it takes)."""
    kv = cal.cfg.kv_cache_dtype
    engine = make_engine(cal.cfg, "bf16", DEFAULT_SKIP, cal.max_len, kv)
    kv_only = {"kv_cache": cal.kv_cache(engine)}
    entry = KVCacheProfile(
        dtype=kv,
        kv_scale=engine.config.kv_scale,
        bytes_per_token_bf16=cal.reference.kv_bytes_per_token(),
        bytes_per_token=engine.kv_bytes_per_token(),
        kv_only=kv_only,
    )
    engine = None
    free_memory()
    return entry


def run_profile(cfg: ProfileConfig) -> ProfileResult:
    """Profile `cfg.model` for every scheme of `cfg.quant` (steps in the module doc)."""
    cfg.check()
    schemes = cfg.schemes()
    model_config = ModelConfig.from_model_dir(cfg.model)  # clear errors for a bad directory
    kv_stages = len(schemes) + 1 if cfg.kv_cache_dtype != "bf16" else 0
    stage = Stages(2 + 3 * len(schemes) + kv_stages, cfg.progress)
    with stage("bf16 responses"):
        cal, calibration = calibrate(cfg, model_config)
    logger.info("profile: per-layer errors over %d tokens", calibration.positions)
    with stage(f"per-layer errors over {calibration.positions} tokens"):
        layers = layer_errors(cal.reference, cal.sequences, schemes)
    bf16_bytes = cal.reference.weight_nbytes()
    device = cal.reference.device
    c = model_config
    result = ProfileResult(
        schema_version=SCHEMA_VERSION,
        flashrl_version=flashrl.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=ModelSummary(
            path=str(Path(cfg.model).resolve()),
            family=c.family,
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            tie_word_embeddings=c.tie_word_embeddings,
        ),
        device=str(device),
        device_name=device_name(device),
        dtype=cfg.dtype,
        settings=ProfileSettings(
            schemes=schemes,
            threshold=float(cfg.threshold),
            kv_cache_dtype=cfg.kv_cache_dtype,
            lm_head_fp32=cfg.lm_head_fp32,
            seed=cfg.seed,
            max_prompt_tokens=cal.max_len - cal.params.max_tokens,
            max_new_tokens=cal.params.max_tokens,
            temperature=cfg.temperature,
            smooth=cfg.smooth,
        ),
        calibration=calibration,
        layers=layers,
        baseline={
            "sampled": sampled_mismatch(cal.reference, cal.rollouts, cfg.temperature),
            "decode_tok_s": cal.decode_tok_s,
        },
    )
    for scheme in schemes:
        result.schemes[scheme] = _scheme_entry(cal, scheme, layers, bf16_bytes, stage)
    if cfg.kv_cache_dtype != "bf16":
        with stage(f"bf16 weights + {cfg.kv_cache_dtype} KV cache"):
            result.kv_cache = _kv_cache_entry(cal)
    stage.close()
    result.timings_s = stage.seconds
    return result


def write_profile(result: ProfileResult, path: str | Path) -> Path:
    """Write the JSON document (strict JSON, atomically)."""
    return atomic_write_text(path, json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
