"""`engine_kwargs`: the ``LLM(...)`` keyword arguments for a flashrl rollout config, and
`apply_env_config`, which applies ``FLASHRL_CONFIG`` to an unmodified script's engine arguments.

This module does not import vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from flashrl.core.config import RolloutConfig, resolve_config
from flashrl.core.env import from_env
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.vllm_backend.names import METHOD_NAMES, TRANSFER_BACKEND, WORKER_EXTENSION

ADDITIONAL_CONFIG_KEY = "flashrl_kv_scale"
"""``LLM(additional_config={...})`` key holding the rollout config's ``kv_scale`` (read by `WeightUpdater`)."""

logger = logging.getLogger(__name__)

_LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


def rollout_config(scheme: str | RolloutConfig | None = None) -> RolloutConfig:
    """The config `scheme` names (a scheme, a YAML path or a config); None reads ``FLASHRL_CONFIG``
    (and ``FLASHRL_LMHEAD_FP32``), and without them gives the defaults (bf16)."""
    if scheme is None:
        return from_env() or RolloutConfig()
    return resolve_config(scheme, source="scheme")


def refuse_builtin_only(config: RolloutConfig) -> None:
    """A ValueError naming a rollout setting only the built-in engine honours."""
    if config.lm_head_fp32:
        raise ValueError(
            "lm_head_fp32=True is not supported by the vLLM backend (vLLM computes logits in the model "
            "dtype); use the built-in engine or set lm_head_fp32: false"
        )
    if config.quant != "bf16" and config.quant not in METHOD_NAMES:
        raise ValueError(
            f"quant={config.quant!r} is not supported by the vLLM backend; use the built-in "
            f"engine, or one of: bf16, {', '.join(METHOD_NAMES)}"
        )
    if config.sync_rounding != "nearest":
        raise ValueError(
            f"sync_rounding={config.sync_rounding!r} is not supported by the vLLM backend (vLLM "
            "re-quantizes reloaded weights with its own nearest rounding); use the built-in engine "
            "or set sync_rounding: nearest"
        )


def engine_kwargs(scheme: str | RolloutConfig | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that run rollouts with `scheme`:

    ``LLM(model, **engine_kwargs("int8"))``. `scheme` is a flashrl scheme (``bf16``, ``int8``,
    ``fp8``, ``fp8_channel``, ``fp8_block``, ``int8_g128``, ``int8_g64``), a YAML path or a `RolloutConfig`; None reads
    ``FLASHRL_CONFIG``. The result holds:

    - ``quantization``: ``flashrl_<scheme>`` (absent for bf16), plus ``hf_overrides`` carrying the
      skip list and the smoothing exponent (``smooth``, `flashrl.vllm_backend.smoothing`) when
      either differs from the default;
    - ``logprobs_mode="processed_logprobs"``: logprobs of the distribution actually sampled from;
    - ``weight_transfer_config={"backend": "flashrl"}`` and the ``flashrl_*`` worker extension,
      which `WeightUpdater` uses to update the weights every step;
    - for ``kv_cache_dtype: fp8``: ``kv_cache_dtype="fp8"`` plus ``additional_config=
      {"flashrl_kv_scale": kv_scale}`` (``calibrated`` or a float), which `WeightUpdater` reads to set
      the static per-layer scales at start-up and after every update (vLLM resets them to 1.0 on each
      reload); with ``kv_scale: dynamic``, vLLM's ``fp8_per_token_head`` cache (scales per token and
      head at write time, no calibration), which vLLM 0.32 runs only in CUDA Triton attention.

    Raises ValueError for settings the vLLM backend cannot honour (fp32 LM head; stochastic sync
    rounding; dynamic KV scales without a CUDA device). Smoothing a model with quantized MoE experts
    is refused when vLLM builds it (`ConfigError` naming the experts).
    """
    config = rollout_config(scheme)
    refuse_builtin_only(config)
    kwargs: dict[str, Any] = {
        "logprobs_mode": _LOGPROBS_MODES[config.logprobs_mode],
        "weight_transfer_config": {"backend": TRANSFER_BACKEND},
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if config.quant != "bf16":
        method = METHOD_NAMES[config.quant]
        kwargs["quantization"] = method
        if tuple(config.skip) != DEFAULT_SKIP or config.smooth is not None:
            quant_config: dict[str, Any] = {"quant_method": method, "skip": list(config.skip)}
            if config.smooth is not None:
                quant_config["smooth"] = config.smooth
            kwargs["hf_overrides"] = {"quantization_config": quant_config}
    if config.kv_cache_dtype == "fp8" and config.kv_scale == "dynamic":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "kv_scale='dynamic' maps to vLLM's fp8_per_token_head KV cache, which vLLM 0.32 runs only in CUDA "
                "Triton attention (on CPU it is accepted but gives wrong results); on CPU use kv_scale: calibrated"
            )
        kwargs["kv_cache_dtype"] = "fp8_per_token_head"
    elif config.kv_cache_dtype == "fp8":
        kwargs["kv_cache_dtype"] = "fp8"
        kwargs["additional_config"] = {ADDITIONAL_CONFIG_KEY: config.kv_scale}
    return kwargs


def apply_env_config(engine_args: Any) -> list[str]:
    """Apply ``FLASHRL_CONFIG`` to a ``vllm.EngineArgs`` in place; returns the fields it changed.

    Only fields the user left at their defaults are changed: an explicit ``quantization`` other
    than a flashrl method wins over the variable (logged), and so does an explicit
    ``worker_extension_cls`` or ``weight_transfer_config``. ``logprobs_mode`` is set to the
    config's mode when it is vLLM's default (``raw_logprobs``).
    """
    config = from_env()
    if config is None:
        return []
    wanted = engine_kwargs(config)
    changed: list[str] = []
    method = wanted.get("quantization")
    if engine_args.quantization is None:
        if method is not None:
            engine_args.quantization = method
            changed.append("quantization")
    elif engine_args.quantization != method:
        logger.warning(
            "FLASHRL_CONFIG asks for %s but LLM(quantization=%r) was given explicitly; keeping %r",
            method or "bf16",
            engine_args.quantization,
            engine_args.quantization,
        )
    if engine_args.logprobs_mode == "raw_logprobs" and wanted["logprobs_mode"] != "raw_logprobs":
        engine_args.logprobs_mode = wanted["logprobs_mode"]
        changed.append("logprobs_mode")
    if engine_args.weight_transfer_config is None:
        from vllm.config import WeightTransferConfig

        engine_args.weight_transfer_config = WeightTransferConfig(
            **wanted["weight_transfer_config"]
        )
        changed.append("weight_transfer_config")
    if not engine_args.worker_extension_cls:
        engine_args.worker_extension_cls = wanted["worker_extension_cls"]
        changed.append("worker_extension_cls")
    changed += _apply_skip_and_kv_cache(engine_args, wanted, method)
    if changed:
        logger.info(
            "FLASHRL_CONFIG set %s",
            ", ".join(f"{name}={getattr(engine_args, name)!r}" for name in changed),
        )
    return changed


def _apply_skip_and_kv_cache(
    engine_args: Any, wanted: dict[str, Any], method: str | None
) -> list[str]:
    """The skip list (``hf_overrides``) and the fp8 KV cache of `wanted` (`engine_kwargs` of
    ``FLASHRL_CONFIG``), where the user left them at their defaults; returns the fields changed."""
    changed: list[str] = []
    if "hf_overrides" in wanted and engine_args.quantization == method:
        overrides = engine_args.hf_overrides
        if overrides is None or isinstance(overrides, dict):
            merged = dict(overrides or {})
            merged.setdefault("quantization_config", wanted["hf_overrides"]["quantization_config"])
            engine_args.hf_overrides = merged
            changed.append("hf_overrides")
        else:
            logger.warning("FLASHRL_CONFIG skip list not applied: hf_overrides is a callable")
    if "kv_cache_dtype" in wanted and engine_args.kv_cache_dtype == "auto":
        engine_args.kv_cache_dtype = wanted["kv_cache_dtype"]
        changed.append("kv_cache_dtype")
        if "additional_config" in wanted and isinstance(engine_args.additional_config, dict):
            engine_args.additional_config = {
                **wanted["additional_config"],
                **engine_args.additional_config,
            }
            changed.append("additional_config")
            logger.warning(
                "FLASHRL_CONFIG asks for an fp8 KV cache: flashrl's WeightUpdater / VLLMBackend set its scales "
                "at start-up and after each update; an engine whose weights are reloaded by other code runs "
                "with vLLM's default scales of 1.0"
            )
    return changed
