"""The engines and the calibration data of `flashrl profile` (`flashrl.tools.profile`): one bf16
reference engine, the calibration prompts and its sampled responses, shared by every measurement so
that comparisons between schemes, skip lists and smoothing are paired."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from flashrl.core.config import RolloutConfig
from flashrl.core.rollout import Rollout
from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.errors import UnsupportedError
from flashrl.model.config import ModelConfig
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.tools.calibration_prompts import calibration_prompts
from flashrl.tools.profile_config import ProfileConfig
from flashrl.tools.profile_metrics import distribution_mismatch, sampled_mismatch
from flashrl.tools.profile_schema import CalibrationSummary
from flashrl.tools.verify_context import scheme_unsupported_reason

logger = logging.getLogger(__name__)

MAX_BATCH = 16


def make_engine(
    cfg: ProfileConfig,
    quant: str,
    skip: Sequence[str],
    max_len: int,
    kv_cache_dtype: str = "bf16",
    smooth: float | None = None,
) -> Engine:
    """An engine of the profiled model with `quant`, `skip` kept unquantized and, with `smooth`,
    online smoothing (calibrated by its first generate)."""
    config = RolloutConfig(
        quant=quant,
        skip=tuple(skip),
        lm_head_fp32=cfg.lm_head_fp32,
        kv_cache_dtype=kv_cache_dtype,
        smooth=smooth,
    )
    engine = EngineConfig(
        dtype=cfg.dtype,
        device=cfg.device,
        max_batch=MAX_BATCH,
        max_len=max_len,
        seed=cfg.seed,
        progress=False,
    )
    return Engine(cfg.model, config, engine)


class Stages:
    """The profile's progress bar: one tick per stage, the stage under way as its postfix (a
    profile of four schemes takes minutes; it used to print nothing meanwhile)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.bar = tqdm(total=total, desc="profile", unit="stage", disable=not enabled)
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, label: str) -> Iterator[None]:
        self.bar.set_postfix_str(label)
        start = time.perf_counter()
        yield
        self.seconds[label] = time.perf_counter() - start
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def free_memory() -> None:
    """Release the memory of engines the caller dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Calibration:
    """What every end-to-end measurement of one profile shares."""

    cfg: ProfileConfig
    reference: Engine
    prompts: list[list[int]]
    params: SamplingParams
    rollouts: list[Rollout]
    max_len: int
    decode_tok_s: float = 0.0
    """The bf16 reference's decode tokens/s while it sampled the calibration responses."""
    _reference_logits: list[torch.Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def sequences(self) -> list[list[int]]:
        return [r.prompt_ids + r.response_ids for r in self.rollouts]

    def exact(self, engine: Engine) -> dict[str, float]:
        """`profile_metrics.distribution_mismatch` of `engine` against the reference, whose logits
        are computed once per profile (positions x vocab fp32: 0.26 GB for SmolLM2-135M) rather
        than once per engine compared."""
        if self._reference_logits is None:
            self._reference_logits = [self.reference.logits(seq) for seq in self.sequences]
        return distribution_mismatch(
            self.reference, engine, self.sequences, self.cfg.temperature, self._reference_logits
        )

    def mismatch(
        self, engine: Engine, kv: bool = False, exact: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """`engine` against the bf16 reference: exact (`exact` when already measured on this
        engine), sampled and, with `kv`, ``kv_cache`` (`kv_cache`), and the engine's decode
        tokens/s while it sampled (prefill and a smoothing engine's calibration excluded). The
        sampled rollouts come first: a smoothing engine calibrates on its first generate."""
        t = self.cfg.temperature
        before = engine.stats()
        sampled = engine.generate(self.prompts, self.params)
        after = engine.stats()
        seconds = after["decode_s"] - before["decode_s"]
        tokens = after["generated_tokens"] - before["generated_tokens"]
        return {
            "exact": exact if exact is not None else self.exact(engine),
            "sampled": sampled_mismatch(self.reference, sampled, t),
            "kv_cache": self.kv_cache(engine) if kv else None,
            "decode_tok_s": tokens / seconds if seconds else 0.0,
        }

    def kv_cache(self, engine: Engine) -> dict[str, float] | None:
        """`Engine.kv_cache_mismatch` on the calibration responses (None for a bf16 cache): two
        teacher-forced passes through the cache, as costly as two generates, so a profile runs it
        once per scheme, on the recommended config. Calibrated fp8 KV scales come from the
        calibration sequences for every config, so that configs are compared on equal terms."""
        if self.cfg.kv_cache_dtype == "bf16":
            return None
        if engine.kv_calibrated:
            engine.calibrate_kv(self.sequences)
        kept = [r for r in self.rollouts if r.response_ids]
        return engine.kv_cache_mismatch(
            [r.prompt_ids for r in kept], [r.response_ids for r in kept], self.cfg.temperature
        )


def calibrate(
    cfg: ProfileConfig, model_config: ModelConfig
) -> tuple[Calibration, CalibrationSummary]:
    """The bf16 reference engine, the calibration prompts and its responses to them."""
    # Prompt and response budgets within the model's context.
    max_new = min(cfg.max_new_tokens, max(1, model_config.max_position_embeddings // 2))
    max_prompt = min(cfg.max_prompt_tokens, model_config.max_position_embeddings - max_new)
    reference = make_engine(cfg, "bf16", DEFAULT_SKIP, max_prompt + max_new)
    for scheme in cfg.schemes():
        reason = scheme_unsupported_reason(scheme, reference.device)
        if reason:
            raise UnsupportedError(f"--quant {scheme}: cannot run on {reference.device}: {reason}")
    prompts, calibration = calibration_prompts(
        reference, max_prompt, cfg.prompts, cfg.seed, cfg.model
    )
    params = SamplingParams(temperature=cfg.temperature, max_tokens=max_new, seed=cfg.seed)
    logger.info("profile: sampling %d bf16 responses", len(prompts))
    rollouts = reference.generate(prompts, params)
    cal = Calibration(
        cfg, reference, prompts, params, rollouts, max_prompt + max_new,
        decode_tok_s=reference.stats()["decode_tokens_per_s"],
    )  # fmt: skip
    sequences = cal.sequences
    summary = CalibrationSummary(
        **calibration,
        num_sequences=len(sequences),
        prompt_tokens=sum(len(p) for p in prompts),
        response_tokens=sum(len(r.response_ids) for r in cal.rollouts),
        positions=sum(len(s) for s in sequences),
    )
    return cal, summary
