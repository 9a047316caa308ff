"""The built-in rollout engine: an inference decoder with quantized linear layers, a slot KV cache,
continuous batching, exact sampling logprobs and in-place weight sync."""

from flashrl.engine.sampler import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    # Engine is imported lazily: `flashrl.rollout` imports `flashrl.engine.sampler`, and the engine
    # module imports `flashrl.rollout`.
    if name == "Engine":
        from flashrl.engine.engine import Engine

        return Engine
    raise AttributeError(name)
