"""The built-in rollout engine: an inference decoder with quantized linear layers, a slot KV cache,
continuous batching, exact sampling logprobs and in-place weight update."""

from flashrl.core.sampling import SamplingParams
from flashrl.engine.engine import Engine
from flashrl.engine.options import EngineConfig

__all__ = ["Engine", "EngineConfig", "SamplingParams"]
