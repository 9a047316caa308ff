"""The ``vllm.general_plugins`` entry point: ``flashrl = "flashrl.vllm_backend.plugin:register"``.

vLLM calls `register` once in every process it starts (the ``LLM`` process, the engine core and
each worker). It registers:

1. the quantization configs ``flashrl_int8``, ``flashrl_fp8``, ``flashrl_fp8_channel``,
   ``flashrl_fp8_block``, ``flashrl_int8_g128`` and ``flashrl_int8_g64``
   (`register_quantization_config`);
2. the ``flashrl`` weight-transfer backend (`WeightTransferEngineFactory.register_engine`);
3. only when ``FLASHRL_CONFIG`` is set: ``FLASHRL_LOGGING_LEVEL`` / ``FLASHRL_LOGGING_FILE`` are
   applied to the ``flashrl`` logger, and the one hook flashrl puts into vLLM, a wrapper around the
   public ``EngineArgs.create_engine_config`` that fills in `engine_kwargs(FLASHRL_CONFIG)` for
   arguments the script left at their defaults (`flashrl.vllm_backend.config.apply_env_config`).
   That is what makes ``FLASHRL_CONFIG=int8 python unmodified_script.py`` switch an ``LLM(model)``
   to int8 rollouts. Tested with vLLM 0.32.0.

This module imports vLLM only inside `register`; `register` is idempotent.
"""

from __future__ import annotations

import functools
import logging
import os

from flashrl.vllm_backend.names import TRANSFER_BACKEND

logger = logging.getLogger(__name__)

_registered = False
"""Process-wide on purpose: what `register` changes (vLLM's quantization and transfer registries,
``EngineArgs``, the ``flashrl`` logger) exists once per process and is shared by every engine in it,
so "already done" is a fact about the process, not about an engine."""
ENV_HOOK_MARKER = "__flashrl_env_hook__"


def register() -> None:
    """Register flashrl's quantization methods and weight-transfer backend with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from flashrl.vllm_backend.install_check import check_vllm_install

    warning = check_vllm_install()  # raises on a CUDA/CPU vLLM mix, before vLLM fails obscurely
    if warning:
        logger.warning(warning)
    import vllm
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.layers.quantization import register_quantization_config

    from flashrl.vllm_backend.quant_config import CONFIG_CLASSES

    for config_cls in CONFIG_CLASSES:
        register_quantization_config(config_cls.method_name())(config_cls)
    try:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "flashrl.vllm_backend.transfer", "FlashRLWeightTransferEngine"
        )
    except ValueError:  # already registered in this process (register() called directly before)
        pass
    if os.environ.get("FLASHRL_CONFIG"):
        # An unmodified script never configures flashrl's logger: apply FLASHRL_LOGGING_LEVEL /
        # FLASHRL_LOGGING_FILE here, so the scheme, the quantized layers and every re-quantization show.
        from flashrl.core.env import configure_logging

        configure_logging()
        install_env_hook()
        logger.info(
            "flashrl plugin registered in process %d with FLASHRL_CONFIG=%s (vLLM %s)",
            os.getpid(),
            os.environ["FLASHRL_CONFIG"],
            vllm.__version__,
        )
    _registered = True


def install_env_hook() -> bool:
    """Wrap ``vllm.engine.arg_utils.EngineArgs.create_engine_config`` so that it applies
    ``FLASHRL_CONFIG`` first (see `apply_env_config`). Returns False when already installed."""
    from vllm.engine.arg_utils import EngineArgs

    from flashrl.vllm_backend.config import apply_env_config

    original = EngineArgs.create_engine_config
    if getattr(original, ENV_HOOK_MARKER, False):
        return False

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        apply_env_config(self)
        return original(self, *args, **kwargs)

    setattr(create_engine_config, ENV_HOOK_MARKER, True)
    EngineArgs.create_engine_config = create_engine_config
    return True
