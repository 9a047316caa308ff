"""The RL loop: GRPO / DAPO with quantized rollouts, per-step weight sync and rollout correction.

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
7. Weight sync: the trainer's parameters stream by name into the backend (or are broadcast to the
   workers), which re-quantizes in place with fresh scales. Each phase's time is logged.

Outputs in `output_dir`: `metrics.jsonl` (one line per step), `config.yaml`, checkpoints in
Hugging Face format (`checkpoint-N/`, loadable by the engine and by `transformers`) with the
optimizer state for resume, and `curves.png`. One directory holds one run: a fresh run refuses a
directory that holds another (`overwrite` deletes it), a resume checks the checkpoint's config;
how the files survive crashes is in `flashrl.rl.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashrl.core.device import peak_memory_bytes, resolve_device, resolve_dtype
from flashrl.core.env import from_env
from flashrl.core.rollout import Rollout, RolloutBackend
from flashrl.core.sampling import SamplingParams
from flashrl.correction import compute_correction
from flashrl.engine.inputs import load_tokenizer
from flashrl.errors import CheckpointError
from flashrl.model.pretrained import load_causal_lm
from flashrl.model.remote_code import check_no_custom_code
from flashrl.rl import algo
from flashrl.rl import checkpoint as ckpt
from flashrl.rl.batch import Batch, response_logprobs
from flashrl.rl.checkpoint import read_metrics  # noqa: F401 (public here too)
from flashrl.rl.compare import rollout_name
from flashrl.rl.config import TrainConfig
from flashrl.rl.data import Example, prompt_source, render_prompt
from flashrl.rl.durable import append_line
from flashrl.rl.metrics import rollout_metrics
from flashrl.rl.plan import plan_run
from flashrl.rl.rewards import get_reward
from flashrl.rl.routing_replay import build_batch, replay_backend, replay_routing
from flashrl.rl.samples import SAMPLES_FILE, collect, record_samples
from flashrl.rl.update import ppo_update
from flashrl.rl.workers import make_backend, make_rollouts
from flashrl.utils import synchronize

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: TrainConfig, backend: RolloutBackend | None = None) -> None:

        self.config = config
        self.output_dir = ckpt.check_output_dir(config.run.output_dir)
        # the rollout scheme comes from config.rollout, but a bad FLASHRL_* value is an error here
        # as in every other command
        from_env()
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
        self.source = prompt_source(config.data, config.run.seed)
        self.reward_fn = get_reward(config.data.reward)
        self.correction = config.correction
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
        self.pending: dict[int, tuple] = {}  # async: step under way -> (examples, handle)
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

    def _encode(self, examples: list[Example]) -> list[list[int]]:
        d, limit = self.config.data, self.config.algo.max_prompt_tokens
        special = not d.chat_template or not self.tokenizer.chat_template
        out = []
        for ex in examples:
            text = render_prompt(self.tokenizer, ex.prompt, d.chat_template, d.system_prompt)
            ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
            out.append(ids[-limit:])  # keep the end: the question and generation prompt
        return out

    def rollout(self, step: int) -> tuple[list[Example], list[Rollout]]:
        """The examples and rollouts of `step` (already under way with async rollouts)."""
        examples, handle = self.pending.pop(step, None) or self._submit(step)
        return examples, self.rollouts.collect(handle)

    def _submit(self, step: int) -> tuple[list[Example], object]:
        a = self.config.algo
        examples = self.source.batch(step, a.batch_size // a.group_size)
        params = dataclasses.replace(self.sampling, seed=self.config.run.seed * 1_000_003 + step)
        return examples, self.rollouts.submit(self._encode(examples), params)

    def rewards(
        self, examples: list[Example], rollouts: list[Rollout]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Task scores [N] and the overlong penalty [N] (added to the scores to form rewards)."""
        a = self.config.algo
        scores = torch.tensor(
            [self.reward_fn(r.text, examples[r.prompt_index].answer) for r in rollouts]
        )
        lengths = torch.tensor([len(r.response_ids) for r in rollouts])
        return scores, algo.overlong_penalty(
            lengths, a.max_response_tokens, a.overlong_buffer, a.overlong_penalty
        )

    def train_step(self) -> dict[str, float]:
        """Run one RL step (rollout, reward, correction, update, weight sync); returns its
        metrics."""
        c, step, t = self.config.algo, self.step, {}
        start = time.perf_counter()
        stale = int(step in self.pending)
        examples, rollouts = self.rollout(step)
        if self.config.rollout.workers.async_rollouts and step + 1 < self.config.run.steps:
            # one step ahead: generated by the weights before this step's update
            self.pending[step + 1] = self._submit(step + 1)
        t["rollout_s"] = time.perf_counter() - start

        mark = time.perf_counter()
        scores, penalty = self.rewards(examples, rollouts)
        rewards = scores + penalty
        advantages = algo.group_advantages(rewards, c.group_size, c.advantage, c.norm_adv_by_std)
        keep = (
            algo.informative_groups(rewards, c.group_size)
            if c.dynamic_sampling
            else torch.ones(len(rollouts), dtype=torch.bool)
        )
        t["reward_s"] = time.perf_counter() - mark

        metrics: dict[str, float] = {"step": step}
        if self.config.rollout.workers.async_rollouts:
            metrics["rollout/staleness"] = float(stale)
        metrics.update(rollout_metrics(rollouts, scores, rewards, penalty, keep))
        trainer_means: dict[int, float] = {}
        if keep.any():
            kept = [i for i, k in enumerate(keep.tolist()) if k]
            batch = build_batch(  # a ReplayBatch when the rollouts carry routing
                [rollouts[i] for i in kept], advantages[keep], self.device
            )
            update_metrics, means = self._update(batch, t)
            metrics.update(update_metrics)
            trainer_means = dict(zip(kept, means.tolist()))
            mark = time.perf_counter()
            sync = self.rollouts.update_weights(self.policy.named_parameters())
            t["weight_update_s"] = time.perf_counter() - mark
            if "sent_bytes" in sync:
                metrics["weight_update/sent_bytes"] = sync.pop("sent_bytes")
            for key in [k for k in sync if k.endswith("_changed_frac") or k.startswith("delta_")]:
                metrics[f"weight_update/{key}"] = sync.pop(key)
            t.update(sync)
        else:
            metrics["skipped_update"] = 1.0
        t["step_s"] = time.perf_counter() - start
        metrics.update({f"time/{k}": v for k, v in t.items()})
        tokens = sum(len(r.response_ids) for r in rollouts)
        metrics["throughput/rollout_tokens_per_s"] = tokens / max(t["rollout_s"], 1e-9)
        metrics["memory/peak_gib"] = peak_memory_bytes(self.device) / 2**30
        self._record_samples(examples, rollouts, scores, trainer_means)
        self.step += 1
        return metrics

    def _record_samples(
        self,
        examples: list[Example],
        rollouts: list[Rollout],
        scores: torch.Tensor,
        trainer_means: dict[int, float],
    ) -> None:
        r = self.config.run
        if r.samples_per_step:
            prompts = [self.tokenizer.decode(ids) for ids in self._encode(examples)]
            record_samples(
                self.samples_path,
                collect(
                    self.step,
                    prompts,
                    [ex.answer for ex in examples],
                    rollouts,
                    scores.tolist(),
                    trainer_means,
                    self.config.algo.group_size,
                    r.samples_per_step,
                ),
                print_now=bool(r.print_samples_every) and self.step % r.print_samples_every == 0,
            )

    def _update(self, batch: Batch, t: dict[str, float]) -> tuple[dict[str, float], torch.Tensor]:
        """The PPO update of `batch`: its metrics, and the trainer's mean logprob per row before
        the update (for samples.jsonl)."""
        mark = time.perf_counter()
        self.policy.eval()
        with torch.no_grad():
            old, entropy = self._logprobs(self.policy, batch, with_entropy=True)
            ref = self._logprobs(self.reference, batch)[0] if self.reference is not None else None
        t["logprobs_s"] = time.perf_counter() - mark
        # decoupled: PPO ratio against the trainer's own recompute, IS weights correct
        # pi_old / pi_roll; bypass: the ratio is taken against the rollout logprobs and the weights
        # only carry rejection
        corr = compute_correction(old, batch.rollout_logprobs, batch.response_mask, self.correction)
        ratio_base = old if self.correction.mode == "decoupled" else batch.rollout_logprobs
        metrics = {f"rollout_corr/{k}": v for k, v in corr.metrics.items()}
        mask = batch.response_mask.to(old.dtype)
        means = (old * mask).sum(1).cpu() / mask.sum(1).clamp(min=1).cpu()
        metrics["actor/entropy"] = (entropy * batch.response_mask).sum().item() / max(
            batch.response_mask.sum().item(), 1
        )

        mark = time.perf_counter()
        self.policy.train()
        actor = ppo_update(
            self.policy,
            self.optimizer,
            batch,
            corr,
            ratio_base,
            ref,
            lambda part: self._logprobs(self.policy, part)[0],
            self.config.algo,
            self.config.run.micro_batch_size,
            self._lr(),
        )
        synchronize(self.device)
        t["train_s"] = time.perf_counter() - mark
        metrics.update({f"actor/{k}": v for k, v in actor.items()})
        metrics["actor/lr"] = self._lr()
        return metrics, means

    def _logprobs(self, model, batch: Batch, with_entropy: bool = False):
        outs, ents = [], []
        micro = self.config.run.micro_batch_size
        for start in range(0, len(batch), micro):
            part = batch.select(slice(start, start + micro))
            with replay_routing(model, getattr(part, "routed_experts", None)):
                lp, ent = response_logprobs(model, part, self.sampling, with_entropy)
            outs.append(lp)
            ents.append(ent)
        return torch.cat(outs), (torch.cat(ents) if with_entropy else None)

    def _lr(self) -> float:
        c = self.config.algo
        if c.warmup_steps > 0 and self.step < c.warmup_steps:
            return c.lr * (self.step + 1) / c.warmup_steps
        return c.lr

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
        self.pending.clear()
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
