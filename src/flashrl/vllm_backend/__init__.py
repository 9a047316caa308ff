"""flashrl inside vLLM: online INT8 / FP8 rollouts re-quantized every step, through vLLM's extension points.

    from vllm import LLM
    from flashrl.vllm_backend import WeightUpdater, engine_kwargs

    llm = LLM(model_dir, **engine_kwargs("int8"))      # or FLASHRL_CONFIG=int8 and engine_kwargs()
    updater = WeightUpdater(llm)
    for step in ...:
        outputs = llm.generate(prompts, sampling_params)   # logprobs: processed, as sampled
        ...train...
        stats = updater.update_weights(trainer.named_parameters())  # re-quantized, prefix cache reset

| module          | what                                                                                 |
|-----------------|--------------------------------------------------------------------------------------|
| `plugin`        | ``vllm.general_plugins`` entry point: registers the methods, the transfer backend, the FLASHRL_CONFIG hook |
| `quant_config`  | ``flashrl_<scheme>`` configs (int8, fp8, fp8_channel, fp8_block, int8_g128, int8_g64): a method per layer |
| `quant_methods` | the quantized linear method (re-quantized in place on every load), `dense_methods` the high-precision ones |
| `smoothing`     | online SmoothQuant (``smooth``): factors refreshed at every load, statistics in the forward |
| `moe_methods`   | quantized routed experts (`moe_loading`: their direct-load weight loaders)            |
| `direct_load`, `kernels` | a trainer's `model.load_weights` into quantized layers; vLLM's scaled-mm kernels |
| `transfer`      | the ``flashrl`` weight-transfer backend and the ``flashrl_*`` worker methods        |
| `config`        | `engine_kwargs` (``LLM(...)`` arguments for a scheme) and the FLASHRL_CONFIG handling |
| `weight_update` | `WeightUpdater`: trainer parameters -> running ``LLM``, grouped by layer, with timings |
| `backend`       | `VLLMBackend`: the `flashrl.core.RolloutBackend` protocol on top of ``vllm.LLM``       |

Importing this package does not import vLLM; `WeightUpdater` and `VLLMBackend` import it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashrl.vllm_backend.config import engine_kwargs, rollout_config
from flashrl.vllm_backend.names import METHOD_NAMES, TESTED_VLLM_VERSIONS, TRANSFER_BACKEND

if TYPE_CHECKING:
    from flashrl.vllm_backend.backend import VLLMBackend
    from flashrl.vllm_backend.weight_update import WeightUpdater

__all__ = [
    "METHOD_NAMES",
    "TESTED_VLLM_VERSIONS",
    "TRANSFER_BACKEND",
    "VLLMBackend",
    "WeightUpdater",
    "engine_kwargs",
    "rollout_config",
]

_LAZY = {
    "VLLMBackend": "flashrl.vllm_backend.backend",
    "WeightUpdater": "flashrl.vllm_backend.weight_update",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
