"""`VLLMBackend`: the `flashrl.core.rollout.RolloutBackend` protocol on top of ``vllm.LLM``.

The trainer talks to this class exactly as to the built-in engine: `generate` returns `Rollout`s
whose ``logprobs`` are vLLM's processed logprobs (the distribution sampled from: temperature,
top-k, top-p applied), `update_weights` sends new weights through `WeightUpdater` (re-quantizing
in vLLM), and `stats` reports counters and seconds per phase.

Raw logprobs (``SamplingParams(raw_logprobs=True)``) are not returned by vLLM alongside processed
ones; they are computed by a second, prefill-only pass over prompt + response with vLLM's prompt
logprobs (always raw).

FP8 KV cache with calibrated scales: every `generate` hands its sequences (prompt + response) to
`WeightUpdater.remember_kv`, so each update recalibrates on the latest rollouts; the first `generate`
recalibrates the start-up scales (computed from random token ids) on its own prompts first.

Online smoothing (``smooth``): the first `generate` calibrates the factors on its own prompts, as
the built-in engine does (`WeightUpdater.calibrate_smoothing`: a prefill, then the checkpoint
reloaded with fresh factors; ``smooth_calibration_s`` in `stats`); every update refreshes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from flashrl.core.config import RolloutConfig
from flashrl.core.rollout import FINISH_REASONS, Rollout
from flashrl.core.sampling import SamplingParams
from flashrl.model.remote_code import NO_REMOTE_CODE, check_no_custom_code, check_trust_remote_code
from flashrl.vllm_backend.config import engine_kwargs, rollout_config


def _dtype_name(dtype: str | torch.dtype) -> str:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


class VLLMBackend:
    """Rollouts from vLLM with flashrl's online quantization.

    `config`: a scheme name, a YAML path or a `RolloutConfig` (None reads ``FLASHRL_CONFIG``).
    `llm_kwargs` go to ``vllm.LLM`` and override `engine_kwargs(config)`, e.g. ``max_model_len``,
    ``enforce_eager`` or ``gpu_memory_utilization``.
    """

    def __init__(
        self,
        model_dir: str,
        config: RolloutConfig | str | None = None,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        from vllm import LLM

        from flashrl.vllm_backend.weight_update import WeightUpdater

        check_trust_remote_code(llm_kwargs, "VLLMBackend(**llm_kwargs)")
        check_no_custom_code(model_dir)  # vLLM loads the folder with transformers too
        self.config = rollout_config(config)
        kwargs = {
            **engine_kwargs(self.config),
            "dtype": _dtype_name(dtype),
            "seed": seed,
            **llm_kwargs,
            **NO_REMOTE_CODE,
        }
        self.llm = LLM(str(model_dir), **kwargs)
        self.updater = WeightUpdater(self.llm)
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "generate_calls",
                "prompts",
                "sequences",
                "prompt_tokens",
                "generated_tokens",
                "generate_s",
                "raw_logprob_s",
                "weight_updates",
                "weight_update_s",
                "transfer_s",
                "requantize_s",
                "kv_calibration_s",
                "smooth_calibration_s",
            ),
            0.0,
        )

    # ------------------------------------------------------------------ RolloutBackend

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Rollout]:
        """Sample `params.n` responses per prompt (text or token ids); prompt-major order.

        vLLM refuses ``n > 1`` with greedy sampling, so greedy requests are repeated instead.
        """
        start = time.perf_counter()
        self._first_calibrations(prompts)
        repeat = params.n if params.greedy else 1
        requests = [self._prompt(p) for p in prompts for _ in range(repeat)]
        outputs = self.llm.generate(
            requests, self._vllm_params(params, params.n // repeat), use_tqdm=False
        )
        rollouts: list[Rollout] = []
        for request_index, output in enumerate(outputs):
            prompt_ids = list(output.prompt_token_ids)
            for completion in sorted(output.outputs, key=lambda c: c.index):
                response_ids = list(completion.token_ids)
                logprobs = (
                    [step[token].logprob for step, token in zip(completion.logprobs, response_ids)]
                    if params.logprobs
                    else []
                )
                reason = completion.finish_reason
                if reason not in FINISH_REASONS:
                    raise RuntimeError(
                        f"vLLM finished a request with reason {reason!r}; expected one of {FINISH_REASONS}"
                    )
                rollouts.append(
                    Rollout(
                        prompt_ids=prompt_ids,
                        response_ids=response_ids,
                        text=completion.text,
                        logprobs=logprobs,
                        finish_reason=reason,
                        prompt_index=request_index // repeat,
                        sample_index=request_index % repeat + completion.index,
                    )
                )
        self._stats["generate_s"] += time.perf_counter() - start
        ordered = sorted(
            rollouts, key=lambda r: (r.sample_index, r.prompt_index)
        )  # one sample per prompt first
        self.updater.remember_kv(r.prompt_ids + r.response_ids for r in ordered)
        if params.raw_logprobs:
            raw_start = time.perf_counter()
            for rollout, raw in zip(
                rollouts, self.raw_logprobs([(r.prompt_ids, r.response_ids) for r in rollouts])
            ):
                rollout.raw_logprobs = raw
            self._stats["raw_logprob_s"] += time.perf_counter() - raw_start
        self._stats["generate_calls"] += 1
        self._stats["prompts"] += len(prompts)
        self._stats["sequences"] += len(rollouts)
        self._stats["prompt_tokens"] += sum(len(o.prompt_token_ids) for o in outputs)
        self._stats["generated_tokens"] += sum(len(r.response_ids) for r in rollouts)
        return rollouts

    def _first_calibrations(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> None:
        """Before the first update: calibrate the smoothing factors, then the fp8 KV scales (start-up
        ones come from random token ids), on these prompts."""
        up = self.updater
        if up.smoothing_pending:  # also sets the fp8 KV scales on these prompts
            self._stats["smooth_calibration_s"] += up.calibrate_smoothing(self._token_ids(prompts))
        if up.kv.calibrated and up.kv.from_fallback and up.version == 0:
            self._stats["kv_calibration_s"] += up.calibrate_kv(self._token_ids(prompts))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Update vLLM's weights (Hugging Face names); returns `WeightUpdater.update_weights`'s
        stats."""
        timings = self.updater.update_weights(named_tensors)
        self._stats["weight_updates"] += 1
        for key in ("weight_update_s", "transfer_s", "requantize_s", "kv_calibration_s"):
            self._stats[key] += timings[key]
        return timings

    def stats(self) -> dict[str, float]:
        """Every key of `flashrl.core.rollout.BACKEND_STATS` (``kv_calibration_s`` includes
        start-up), ``raw_logprob_s``, ``smooth_calibration_s`` (the first smoothing calibration), plus the current fp8 KV scales (``kv_{k,v}_scale_{mean,max}``)
        when they are calibrated."""
        stats = dict(self._stats)
        stats["kv_calibration_s"] += self.updater.kv_start_s
        generate_s = stats["generate_s"]
        stats["tokens_per_s"] = stats["generated_tokens"] / generate_s if generate_s > 0 else 0.0
        stats.update(self.updater.kv.summary())
        return stats

    # ------------------------------------------------------------------ extras

    def raw_logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[list[float]]:
        """Raw logprobs (log-softmax of the unprocessed logits) of each response after its prompt,
        from one prefill of prompt + response (vLLM's prompt logprobs)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[*p, *r]) for p, r in sequences]
        params = VllmSamplingParams(
            max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False
        )
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for (prompt_ids, response_ids), output in zip(sequences, outputs):
            steps = output.prompt_logprobs[len(prompt_ids) :]
            result.append([step[token].logprob for step, token in zip(steps, response_ids)])
        return result

    def close(self) -> None:
        """Shut the engine down (its processes, in multiprocessing mode)."""
        engine_core = getattr(getattr(self, "llm", None), "llm_engine", None)
        engine_core = getattr(engine_core, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _token_ids(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of text or id prompts (text through the engine's tokenizer)."""
        tokenizer = None
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                tokenizer = tokenizer or self.llm.get_tokenizer()
                out.append(list(tokenizer.encode(prompt)))
            else:
                out.append([int(t) for t in prompt])
        return out

    @staticmethod
    def _prompt(prompt: str | Sequence[int]) -> Any:
        if isinstance(prompt, str):
            return prompt
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=[int(t) for t in prompt])

    @staticmethod
    def _vllm_params(params: SamplingParams, n: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=n,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=0 if params.logprobs else None,
        )
