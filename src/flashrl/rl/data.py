"""Prompt sources for RL: a built-in synthetic arithmetic task and local jsonl / parquet datasets.

Every source is indexed by step: ``source.batch(step, size)`` is a pure function of (seed, step),
so resuming from a checkpoint at step k draws exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flashrl.core.fields import choice
from flashrl.errors import ConfigError, InputError, UnsupportedError
from flashrl.fileio import check_input_file
from flashrl.rl.rewards import REWARDS

TASK_TEMPLATE = "{a}{op}{b}="


@dataclass
class DataConfig:
    """Prompts, reference answers and how responses are scored."""

    path: str | None = None
    """A local .jsonl / .json / .parquet dataset; None uses the built-in arithmetic task."""
    prompt_field: str = "question"
    """The dataset field that holds the prompt (GSM8K: question)."""
    answer_field: str = "answer"
    """The dataset field that holds the reference answer the reward compares against."""
    prompt_template: str = "{prompt}"
    """How a dataset prompt is worded; must contain {prompt} (e.g. "{prompt} Answer after ####.")."""
    chat_template: bool = True
    """Wrap prompts in the model's chat template when it has one."""
    system_prompt: str | None = None
    """A system turn before each prompt (chat template only); None: no system turn."""
    reward: str = choice("exact_match", REWARDS)
    """How a response is scored against the answer: a name of `flashrl.rl.rewards.REWARDS`
    (exact_match, numeric, math_verify, or one registered with `register_reward`)."""
    task_max_operand: int = 99
    """Largest operand of the built-in arithmetic task."""
    task_min_operand: int = 0
    """Smallest operand of the built-in arithmetic task."""
    task_ops: str = "+"
    """Operators of the built-in arithmetic task."""
    task_template: str = TASK_TEMPLATE
    """How the built-in task words a problem, from {a}, {op} and {b}."""


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class PromptSource(Protocol):
    def batch(self, step: int, size: int) -> list[Example]: ...


@dataclass(frozen=True)
class ArithmeticTask:
    """`a+b=` style problems; the answer is the result as digits.

    Operands are drawn uniformly from [min_operand, max_operand]; `ops` is a string of operators
    among ``+-*``. Subtraction keeps results non-negative. `template` words the problem from
    ``{a}``, ``{op}`` and ``{b}`` (default ``{a}{op}{b}=``, the tiny model's form).
    """

    seed: int = 0
    max_operand: int = 99
    ops: str = "+"
    min_operand: int = 0
    template: str = TASK_TEMPLATE

    def __post_init__(self) -> None:
        if not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(
                f"ops={self.ops!r} is invalid; use a non-empty combination of '+', '-', '*'"
            )
        if self.max_operand < 1 or not 0 <= self.min_operand <= self.max_operand:
            raise ConfigError(
                f"operands [{self.min_operand}, {self.max_operand}]: need max_operand >= 1 and "
                f"0 <= min_operand <= max_operand"
            )
        try:
            self.template.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as err:
            raise ConfigError(
                f"task template {self.template!r} is invalid ({type(err).__name__}: {err}); it "
                "may use {a}, {op} and {b} (write {{ and }} for literal braces)"
            ) from None

    def example(self, rng: random.Random) -> Example:
        lo, hi = self.min_operand, self.max_operand
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        op = rng.choice(self.ops)
        if op == "-" and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return Example(prompt=self.template.format(a=a, op=op, b=b), answer=str(result))

    def batch(self, step: int, size: int) -> list[Example]:
        rng = random.Random(f"{self.seed}:{step}")
        return [self.example(rng) for _ in range(size)]


@dataclass
class FileDataset:
    """Rows of a local jsonl or parquet file with a prompt field and an answer field (GSM8K layout:
    `question` and `answer`). Batches walk through seeded per-epoch permutations."""

    path: str
    prompt_field: str = "question"
    answer_field: str = "answer"
    seed: int = 0
    prompt_template: str = "{prompt}"

    def __post_init__(self) -> None:
        if "{prompt}" not in self.prompt_template:
            raise ConfigError(f"prompt_template {self.prompt_template!r} must contain '{{prompt}}'")
        rows = read_rows(self.path)
        if not rows:
            raise InputError(f"dataset {self.path} has no rows")
        for number, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise InputError(
                    f"dataset {self.path}: row {number} is a {type(row).__name__}; expected an object "
                    f"with fields {self.prompt_field!r} and {self.answer_field!r}"
                )
            missing = [f for f in (self.prompt_field, self.answer_field) if f not in row]
            if missing:
                raise InputError(
                    f"dataset {self.path}: row {number} has no field(s) {', '.join(map(repr, missing))}; fields found: "
                    f"{', '.join(map(str, row))} (choose them with --data.prompt-field / --data.answer-field)"
                )
        try:
            self.examples = [
                Example(
                    self.prompt_template.format(prompt=str(r[self.prompt_field])),
                    str(r[self.answer_field]),
                )
                for r in rows
            ]
        except (
            KeyError,
            IndexError,
            ValueError,
        ) as err:  # other {fields} or stray braces in the template
            raise ConfigError(
                f"prompt_template {self.prompt_template!r} is invalid ({type(err).__name__}: {err}); "
                f"it may use {{prompt}} only (write {{{{ and }}}} for literal braces)"
            ) from None

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
        return order

    def batch(self, step: int, size: int) -> list[Example]:
        out, n = [], len(self.examples)
        for k in range(step * size, (step + 1) * size):
            epoch, index = divmod(k, n)
            out.append(self.examples[self._order(epoch)[index]])
        return out


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a .jsonl / .json (list of objects) / .parquet file."""
    path = check_input_file(path, "dataset file", "a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{path}: not UTF-8 text (byte {err.start})") from None
    if suffix == ".jsonl":
        rows = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
        return rows
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
        if not isinstance(data, list):
            raise InputError(f"{path}: expected a JSON list of objects")
        return data
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UnsupportedError(
                f"reading {path} needs pyarrow: pip install 'flashrl[data]'"
            ) from None
        try:
            return pq.read_table(path).to_pylist()
        except ValueError as err:  # pyarrow.ArrowInvalid: not a parquet file, damaged
            raise InputError(f"{path}: not a readable parquet file ({err})") from None
    raise InputError(
        f"dataset {path}: unsupported file type {suffix!r}; allowed: .jsonl, .json, .parquet"
    )


def render_prompt(
    tokenizer, text: str, use_chat_template: bool = True, system: str | None = None
) -> str:
    """The prompt string the policy sees: the model's chat template (user turn plus generation
    prompt) when it has one and `use_chat_template` is set, else the text itself."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text


def prompt_source(data: DataConfig, seed: int) -> PromptSource:
    """The prompts of `data` (a `DataConfig`): the built-in arithmetic task, or a local file."""
    if data.path is None:
        return ArithmeticTask(
            seed=seed,
            max_operand=data.task_max_operand,
            ops=data.task_ops,
            min_operand=data.task_min_operand,
            template=data.task_template,
        )
    return FileDataset(
        data.path,
        data.prompt_field,
        data.answer_field,
        seed=seed,
        prompt_template=data.prompt_template,
    )
