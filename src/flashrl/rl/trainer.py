"""The RL loop: GRPO / DAPO with quantized rollouts, per-step weight update and rollout correction.

One step, top to bottom (the rollout engine in the trainer's process, or in rollout workers on
Ray with `rollout.workers.count`, docs/distributed.md):

1. Draw `batch_size / group_size` prompts for this step (a pure function of seed and step).
2. Generate `group_size` responses per prompt with the rollout backend: quantized weights (int8 /
   fp8), fp32 logprobs of each sampled token under the processed (temperature, top-k, top-p)
   distribution.
3. Score responses with the reward function (+ DAPO's overlong penalty); group-normalised
   advantages (GRPO, Dr.GRPO or RLOO); optionally drop groups whose rewards are all equal (DAPO
   dynamic sampling).
4. Recompute the same tokens' logprobs with the trainer policy (a `transformers` model in fp32 or
   bf16) at the rollout weights, replaying the rollout's temperature and top-k/top-p truncation.
5. Rollout correction: importance weights from trainer vs rollout logprobs (token TIS, C = 2 by
   default), rejection masks and mismatch metrics (`flashrl.correction`).
6. PPO-clip loss with clip-higher (and optional dual clip, KL to the initial policy) multiplied by
   the IS weights; gradient accumulation over micro-batches; gradient clipping; optimizer step.
   With `mini_batches > 1` the batch is split into several optimizer steps (off-policy within it).
7. Weight update: the trainer's parameters stream by name into the backend (or are broadcast to the
   workers), which re-quantizes in place with fresh scales. Each phase's time is logged.

Each phase is a function or small object in `flashrl.rl.phases` (1-2: generate, 3: score,
4-6: update, 7: weight update, then record), called in order by `Trainer.train_step`; this module keeps
set-up, the loop and checkpoints.

Outputs in `output_dir`: `metrics.jsonl` (one line per step), `config.yaml`, checkpoints in
Hugging Face format (`checkpoint-N/`, loadable by the engine and by `transformers`) with the
optimizer state for resume, and `curves.png`. One directory holds one run: a fresh run refuses a
directory that holds another (`overwrite` deletes it), a resume checks the checkpoint's config;
how the files survive crashes is in `flashrl.rl.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashrl.core.device import resolve_device, resolve_dtype
from flashrl.core.env import from_env
from flashrl.core.rollout import RolloutBackend
from flashrl.core.sampling import SamplingParams
from flashrl.engine.inputs import load_tokenizer
from flashrl.errors import CheckpointError
from flashrl.model.pretrained import load_causal_lm
from flashrl.model.remote_code import check_no_custom_code
from flashrl.rl import checkpoint as ckpt
from flashrl.rl.checkpoint import read_metrics  # noqa: F401 (public here too)
from flashrl.rl.compare import rollout_name
from flashrl.rl.config import TrainConfig
from flashrl.rl.config_checks import rounding_lag_warning
from flashrl.rl.data import prompt_source
from flashrl.rl.durable import append_line
from flashrl.rl.phases.generate import Generator
from flashrl.rl.phases.record import StepResult, record
from flashrl.rl.phases.score import score
from flashrl.rl.phases.update import Learner
from flashrl.rl.phases.weight_update import update_rollout_weights
from flashrl.rl.plan import plan_run
from flashrl.rl.rewards import get_reward
from flashrl.rl.routing_replay import replay_backend
from flashrl.rl.samples import SAMPLES_FILE
from flashrl.rl.workers import make_backend, make_rollouts

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: TrainConfig, backend: RolloutBackend | None = None) -> None:

        self.config = config
        self.output_dir = ckpt.check_output_dir(config.run.output_dir)
        # the rollout scheme comes from config.rollout, but a bad FLASHRL_* value is an error here
        # as in every other command
        from_env()
        lag = rounding_lag_warning(config)
        if lag:
            logger.warning(lag)
        self.device = resolve_device(config.run.device)
        self.model_dir = self._model_dir()
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        if not any((self.model_dir / f).is_file() for f in tokenizer_files):
            raise FileNotFoundError(
                f"model directory {self.model_dir} has no tokenizer (expected "
                f"tokenizer.json or tokenizer_config.json); save one with "
                f"tokenizer.save_pretrained(DIR)"
            )
        resume_dir, state, damaged, discard = plan_run(config, self.output_dir)
        source_dir = resume_dir or self.model_dir
        check_no_custom_code(self.model_dir, source_dir)  # never run code from a model folder
        self.tokenizer = load_tokenizer(self.model_dir)  # damaged files: one error naming them
        self._load_models(source_dir, from_checkpoint=resume_dir is not None)
        source = prompt_source(config.data, config.run.seed)
        self.reward_fn = get_reward(config.data.reward)
        a = config.algo
        self.sampling = SamplingParams(
            temperature=a.temperature,
            top_k=a.top_k,
            top_p=a.top_p,
            max_tokens=a.max_response_tokens,
            n=a.group_size,
        )
        self.step = 0
        if resume_dir is not None:
            self._load_state(resume_dir, state)
        if config.algo.routing_replay:  # MoE: rollouts carry the experts each token used
            backend = replay_backend(backend, lambda: make_backend(config, source_dir, self.device))
        self.backend, self.rollouts = make_rollouts(config, source_dir, self.device, backend)
        self.generator = Generator(config, source, self.tokenizer, self.rollouts, self.sampling)
        self.learner = Learner(
            self.policy, self.reference, self.optimizer, config, self.sampling, self.device
        )
        # every check passed and the models loaded: only now change what is on disk
        ckpt.set_damaged_aside(damaged, resume_dir)
        ckpt.remove(discard, "--run.overwrite")
        ckpt.clean_partial_writes(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        config.save_yaml(self.output_dir / "config.yaml")
        self.metrics_path = self.output_dir / ckpt.METRICS_FILE
        self.samples_path = self.output_dir / SAMPLES_FILE
        if resume_dir is not None:
            ckpt.truncate_metrics(self.metrics_path, self.step)
            ckpt.truncate_metrics(self.samples_path, self.step)

    # ------------------------------------------------------------------ set-up helpers

    def _load_models(self, source_dir: Path, from_checkpoint: bool) -> None:
        """The policy (from `source_dir`), the frozen reference (KL penalty only) and AdamW."""
        c = self.config.algo
        dtype = resolve_dtype(self.config.run.trainer_dtype)
        # a checkpoint's weights load from safetensors only (never a pickled pytorch_model.bin)
        self.policy = load_causal_lm(  # a bad pytorch_model.bin: a CheckpointError naming it
            source_dir, dtype=dtype, use_safetensors=True if from_checkpoint else None
        ).to(self.device)
        self.policy.config.use_cache = False
        self.reference = None
        if c.kl_coef > 0:
            self.reference = load_causal_lm(self.model_dir, dtype=dtype).to(self.device).eval()
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=c.lr, weight_decay=c.weight_decay, betas=(0.9, 0.999)
        )

    def _model_dir(self) -> Path:
        from flashrl.rl.presets import resolve_model

        return resolve_model(self.config.model)

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, float]:
        """One RL step as its phases (`flashrl.rl.phases`): generate, score, update (trainer
        logprobs, correction, policy loss), weight update, record; returns the step's metrics."""
        start = time.perf_counter()
        generated = self.generator.generate(self.step)
        scored = score(generated.examples, generated.rollouts, self.reward_fn, self.config.algo)
        updated = weight_update = None
        if scored.keep.any():  # else every group's rewards are equal (dynamic sampling): skip
            updated = self.learner.update(generated.rollouts, scored, self.step)
            weight_update = update_rollout_weights(self.rollouts, self.policy)
        seconds = time.perf_counter() - start
        result = StepResult(self.step, generated, scored, updated, weight_update, seconds)
        metrics = record(result, self.config, self.device, self.tokenizer, self.samples_path)
        self.step += 1
        return metrics

    # ------------------------------------------------------------------ loop, checkpoints, outputs

    def train(self) -> list[dict[str, float]]:
        c = self.config.run
        history = []
        # in a log file (not a terminal) refresh every 10 s, not on every carriage return
        bar = tqdm(
            total=c.steps,
            initial=self.step,
            desc=f"train ({rollout_name(self.config)})",
            unit="step",
            mininterval=0.1 if sys.stderr.isatty() else 10.0,
        )
        try:
            self._loop(bar, history)
        finally:
            bar.close()
            self.close()
        if history or not (self.output_dir / f"checkpoint-{self.step}").is_dir():
            # (a resume with nothing left to train keeps the checkpoint it loaded)
            self.save_checkpoint()
        return history

    def close(self) -> None:
        """Release the rollout workers (nothing to do in-process)."""
        self.generator.close()
        self.rollouts.close()

    def _loop(self, bar: tqdm, history: list[dict[str, float]]) -> None:
        c = self.config.run
        while self.step < c.steps:
            metrics = self.train_step()
            history.append(metrics)
            append_line(self.metrics_path, json.dumps(metrics))
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}",
                kl=f"{metrics.get('rollout_corr/kl', 0.0):.2e}",
                tok_s=f"{metrics['throughput/rollout_tokens_per_s']:.0f}",
            )
            if c.save_every and self.step % c.save_every == 0 and self.step < c.steps:
                self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        """HF-format weights + tokenizer + optimizer/trainer state in
        `output_dir/checkpoint-<step>`, written to a temporary directory, fsynced and renamed into
        place; then `keep_last` pruning."""
        state = ckpt.trainer_state(self.step, self.optimizer, self.config.to_dict())

        def write(tmp: Path) -> None:
            self.policy.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            torch.save(state, tmp / ckpt.STATE_FILE)

        path = ckpt.write_checkpoint_dir(self.output_dir / f"checkpoint-{self.step}", write)
        ckpt.prune_checkpoints(self.output_dir, self.config.run.keep_last)
        return path

    def _load_state(self, path: Path, state: dict) -> None:
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(
                f"{path / ckpt.STATE_FILE}: optimizer state does not fit this model ({err})"
            ) from None
        self.step = int(state["step"])
        ckpt.restore_rng(state)
        logger.info("resumed from %s at step %d", path, self.step)
