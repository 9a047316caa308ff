"""Routing capture: the expert ids every MoE layer of the engine selected, per rollout.

`RoutingCapture(engine)` watches an engine's forwards (`Decoder.set_routing_observer`) and its
sampling steps (`Engine.add_sample_observer`): a step's rows are its requests, in the order of the
forward that produced its logits (a prefill: one row per slot of the admitted groups, mapped to
their prompt's prefill row by `ModelRunner.last_prefill`; a decode step: row b is slot b). After a
`generate`, `attach(rollouts)` stores in each `Rollout.routed_experts` the int16 ids
[prompt + response - 1, MoE layers, top_k]: the prompt's positions (shared by the samples of a
prompt, as their prefill is) and the input position of every decode step.

Eager decode only: the observers are Python calls, which a compiled decode step cannot make
(`decode_compile` is refused). Bucketed eager steps are fine (padding rows are dropped).
"""

from __future__ import annotations

from typing import Any

import torch

from flashrl.core.rollout import Rollout
from flashrl.engine.sampler import SampledTokens
from flashrl.errors import InputError, UnsupportedError


class RoutingCapture:
    """Records routing of one engine's `generate` calls; see the module docstring."""

    def __init__(self, engine: Any) -> None:
        blocks = engine.model.moe_blocks()
        if not blocks:
            raise UnsupportedError(
                f"routing capture needs an MoE model; {engine.model_dir} "
                f"({engine.model_config.family}) has no MoE layers"
            )
        if engine.decode.mode is not None:
            raise UnsupportedError(
                "routing capture runs Python observers in every forward: use an eager decode step "
                f"(decode_compile=None), not decode_compile={engine.decode.mode!r}"
            )
        self.engine, self.layers = engine, len(blocks)
        self._forward: dict[int, torch.Tensor] = {}
        self._sequences: dict[tuple[int, int], list[torch.Tensor]] = {}
        engine.model.set_routing_observer(self._observe)
        self._remove = engine.add_sample_observer(self._on_step)

    def _observe(self, index: int, ids: torch.Tensor) -> None:
        self._forward[index] = ids

    def _on_step(self, record: SampledTokens) -> None:
        ids = torch.stack([self._forward[i] for i in range(self.layers)], dim=1)
        ids = ids.to("cpu", torch.int16)  # [forward rows, layers, k]
        keys = list(zip(record.prompt_index, record.sample_index))
        if all(step == 0 for step in record.step):  # a prefill: row -> prompt row
            rows, lengths = self.engine.runner.last_prefill
            per_prompt = ids.view(len(lengths), -1, *ids.shape[1:])
            for key, row in zip(keys, rows):
                self._sequences[key] = [per_prompt[row, : lengths[row]]]
        else:  # a decode step: row b is request b
            for b, key in enumerate(keys):
                self._sequences[key].append(ids[b : b + 1])

    def attach(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Set `routed_experts` of each rollout of the latest `generate` (and forget them)."""
        for r in rollouts:
            parts = self._sequences.pop((r.prompt_index, r.sample_index), None)
            if parts is None:
                raise InputError(
                    f"no routing recorded for rollout (prompt {r.prompt_index}, sample "
                    f"{r.sample_index}): attach the rollouts of this engine's latest generate"
                )
            r.routed_experts = torch.cat(parts)
            expected = len(r.prompt_ids) + len(r.response_ids) - 1
            assert r.routed_experts.shape[0] == expected, (r.routed_experts.shape, expected)
        return rollouts

    def close(self) -> None:
        """Stop recording (the engine runs without observers again)."""
        self.engine.model.set_routing_observer(None)
        self._remove()


class RoutingBackend:
    """An `Engine` as a `RolloutBackend` whose rollouts carry `routed_experts` (routing replay).
    Everything else (`update_weights`, `stats`, `logits`, ...) is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.capture = RoutingCapture(engine)

    def generate(self, prompts: Any, params: Any) -> list[Rollout]:
        return self.capture.attach(self.engine.generate(prompts, params))

    def update_weights(self, named_tensors: Any, **kwargs: Any) -> dict[str, float]:
        return self.engine.update_weights(named_tensors, **kwargs)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
