"""The built-in calibration prompts of `flashrl profile` (used when no --prompts file is given).

Short, varied texts in the styles an RL run meets: grade-school math, competition math, code,
instructions, dialogue, structured data, prose and a few non-English lines, so that every linear
layer sees a spread of activations. Written for flashrl; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from flashrl.engine import Engine
from flashrl.errors import ConfigError, InputError
from flashrl.fileio import check_input_file

CALIBRATION_PROMPTS: tuple[str, ...] = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "Solve for x: 3x + 7 = 22. Show your work and put the final answer after ####.",
    "Find all real numbers a such that the polynomial x^3 - ax^2 + 12x - 8 has three equal roots.",
    "What is 17 * 23? Answer: 17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 =",
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\n        return n\n",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and "
    "spaces.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = "
    "orders.customer_id GROUP BY",
    "User: Can you explain what a hash table is, in two sentences?\nAssistant:",
    "Summarize the following paragraph in one sentence: The committee met on Tuesday to discuss "
    "the budget. After a long debate, members agreed to fund the new library but postponed the "
    "decision on the park.",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through",
    '{"id": 42, "name": "widget", "tags": ["blue", "small"], "price": 3.5, "in_stock": true,',
    "1. Preheat the oven to 180 C.\n2. Mix the flour, sugar and eggs.\n3.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Das ist ein bekannter Satz, weil",
    "Prove that the sum of two even integers is even. Proof: Let a = 2m and b = 2n for "
    "integers m, n.",
)
"""16 prompts of 60-220 characters each."""

RANDOM_PROMPTS = 16
"""Calibration prompts of random token ids for a model without a tokenizer."""


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a .jsonl file (JSON strings or objects with "prompt" / "text") or a text file
    (one prompt per non-empty line). Errors name the file and line."""
    path = check_input_file(path, "--prompts: file", "a .txt or .jsonl file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte {err.start})") from None
    prompts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix.lower() == ".jsonl":
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if isinstance(item, dict):
                item = item.get("prompt", item.get("text"))
            if not isinstance(item, str) or not item:
                raise InputError(
                    f"{path}:{number}: expected a JSON string or an object with a "
                    f'"prompt" or "text" string'
                )
            prompts.append(item)
        else:
            prompts.append(line)
    if not prompts:
        raise InputError(f"{path}: no prompts found")
    return prompts


def calibration_prompts(
    engine: Engine,
    max_prompt_tokens: int,
    prompts: str | None = None,
    seed: int = 0,
    model: str = "the model",
) -> tuple[list[list[int]], dict[str, Any]]:
    """Token ids of the calibration prompts (the `prompts` file, else `CALIBRATION_PROMPTS`, else
    for a model without a tokenizer seeded random ids) and a description for the JSON."""
    info: dict[str, Any] = {"source": "builtin", "file": None, "note": None}
    if engine.tokenizer is None:
        if prompts is not None:
            raise ConfigError(
                f"--prompts {prompts}: {model} has no tokenizer, so text prompts cannot be encoded"
            )
        gen = torch.Generator().manual_seed(seed)
        vocab = engine.model_config.vocab_size
        lengths = torch.randint(
            max(1, max_prompt_tokens // 4), max_prompt_tokens + 1, (RANDOM_PROMPTS,), generator=gen
        )
        ids = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]
        info.update(
            source="random_token_ids",
            note=f"the model has no tokenizer: {RANDOM_PROMPTS} prompts of seeded random "
            f"token ids (seed {seed})",
        )
        return ids, info
    texts = list(CALIBRATION_PROMPTS)
    if prompts is not None:
        texts = read_prompts_file(prompts)
        info.update(source="file", file=str(prompts))
    ids = [
        engine.tokenizer(t, add_special_tokens=True)["input_ids"][:max_prompt_tokens] for t in texts
    ]
    ids = [p for p in ids if p]
    if not ids:
        raise InputError("every calibration prompt encodes to zero tokens")
    return ids, info
