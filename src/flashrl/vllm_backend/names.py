"""Names shared by the vLLM-side modules and the vLLM-free configuration code (no vLLM import here)."""

from __future__ import annotations

METHOD_NAMES: dict[str, str] = {
    "int8": "flashrl_int8",
    "fp8": "flashrl_fp8",
    "fp8_channel": "flashrl_fp8_channel",
    "fp8_block": "flashrl_fp8_block",
    "int8_g128": "flashrl_int8_g128",
    "int8_g64": "flashrl_int8_g64",
}
"""flashrl scheme -> the quantization name registered with vLLM (``LLM(quantization=...)``)."""

SCHEME_OF_METHOD: dict[str, str] = {method: scheme for scheme, method in METHOD_NAMES.items()}

TRANSFER_BACKEND = "flashrl"
"""The weight-transfer backend registered with vLLM (``weight_transfer_config={"backend": "flashrl"}``)."""

WORKER_EXTENSION = "flashrl.vllm_backend.transfer.FlashRLWorkerExtension"
"""``LLM(worker_extension_cls=...)``: adds the ``flashrl_*`` worker methods `WeightUpdater` calls."""

TESTED_VLLM_VERSIONS = ("0.32.0",)
