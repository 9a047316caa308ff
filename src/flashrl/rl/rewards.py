"""Reward functions: ``reward(response_text, answer) -> float``, looked up by name.

| name           | reward                                                                                  |
|----------------|-----------------------------------------------------------------------------------------|
| `exact_match`  | 1 if the stripped response equals the stripped answer, else 0                            |
| `numeric`      | 1 if the number the response commits to equals the answer's number (GSM8K `#### 42`,     |
|                | `\\boxed{42}`, else the last number), else 0; commas and `$` are ignored                 |
| `math_verify`  | 1 if `math-verify` judges the response's final answer equivalent to the answer (LaTeX,   |
|                | fractions, expressions); the answer's GSM8K `#### ...` part is used when present         |

Answers in GSM8K layout (`reasoning ... #### 42`) are reduced to the part after `####` first.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from flashrl.errors import ConfigError

RewardFn = Callable[[str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]*)")
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def gold_answer(answer: str) -> str:
    """The final answer of a GSM8K-style solution (the text after the last ``####``), else the text."""
    found = _HASHES.findall(answer)
    return found[-1].strip() if found else answer.strip()


def _to_number(text: str, first: bool = False) -> float | None:
    match = _NUMBER.findall(text.replace("$", ""))
    if not match:
        return None
    try:
        return float(match[0 if first else -1].replace(",", ""))
    except ValueError:
        return None


def extract_number(response: str) -> float | None:
    """The number a response commits to: the first number after the last ``####``, else the one in
    the last ``\\boxed{}``, else the last number in the text."""
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(response)
        if found:
            return _to_number(found[-1], first=True)
    return _to_number(response)


def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == gold_answer(answer))


def numeric(response: str, answer: str) -> float:
    pred, gold = extract_number(response), _to_number(gold_answer(answer), first=True)
    if pred is None or gold is None:
        return 0.0
    return float(abs(pred - gold) <= 1e-6 * max(1.0, abs(gold)))


def math_verify(response: str, answer: str) -> float:
    from math_verify import parse, verify

    gold = parse(gold_answer(answer))
    found = _HASHES.findall(response)
    pred = parse(found[-1] if found else response)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "math_verify": math_verify,
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Make a custom ``fn(response_text, answer) -> float`` available as `reward: name`."""
    if not callable(fn):
        raise TypeError(f"reward {name!r} must be callable")
    REWARDS[name] = fn


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ConfigError(f"unknown reward {name!r}; allowed: {', '.join(REWARDS)}")
    return REWARDS[name]
