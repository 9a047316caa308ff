"""The built-in arithmetic task's operand range and wording (`ArithmeticTask.min_operand`,
`template`) and `prompt_source`, which builds the prompts of a `DataConfig`."""

from __future__ import annotations

import json
import re

import pytest

from flashrl.errors import ConfigError
from flashrl.rl.data import TASK_TEMPLATE, ArithmeticTask, DataConfig, FileDataset, prompt_source


def test_default_template_keeps_the_old_problems():
    """The first problems of seed 0 / step 0 and of a three-operator task, as the task drew them
    before `template` and `min_operand` existed (computed once with that code)."""
    assert TASK_TEMPLATE == "{a}{op}{b}="
    got = [(e.prompt, e.answer) for e in ArithmeticTask(seed=0).batch(0, 3)]
    assert got == [("74+86=", "160"), ("32+99=", "131"), ("93+75=", "168")]
    got = [(e.prompt, e.answer) for e in ArithmeticTask(5, 9, "+-*").batch(2, 3)]
    assert got == [("9+2=", "11"), ("0*9=", "0"), ("5-0=", "5")]


def test_template_words_the_same_problems():
    plain = ArithmeticTask(seed=5, max_operand=9, ops="+-*")
    worded = ArithmeticTask(seed=5, max_operand=9, ops="+-*", template="What is {a} {op} {b}?")
    for p, w in zip(plain.batch(2, 50), worded.batch(2, 50)):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", p.prompt).groups()
        assert w.prompt == f"What is {a} {op} {b}?" and w.answer == p.answer
    braces = ArithmeticTask(seed=1, template="{{{a}}} {op} {b}")
    assert re.fullmatch(r"\{\d+\} \+ \d+", braces.batch(0, 1)[0].prompt)


def test_operands_stay_within_min_and_max():
    task = ArithmeticTask(seed=2, max_operand=20, ops="+-*", min_operand=10)
    seen = set()
    for ex in task.batch(0, 300):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", ex.prompt).groups()
        a, b = int(a), int(b)
        assert 10 <= a <= 20 and 10 <= b <= 20
        assert ex.answer == str(a + b if op == "+" else a - b if op == "-" else a * b)
        seen.update((a, b))
    assert min(seen) == 10 and max(seen) == 20  # both ends are drawn
    single = ArithmeticTask(seed=0, max_operand=7, min_operand=7)
    assert {e.prompt for e in single.batch(0, 5)} == {"7+7="}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"template": "{a}{op}{c}="}, r"template '\{a\}\{op\}\{c\}=' is invalid \(KeyError"),
        ({"template": "{a}{op}{b}={"}, "is invalid"),
        ({"template": "{0}+{1}"}, "is invalid"),
        ({"min_operand": 10, "max_operand": 9}, r"operands \[10, 9\]"),
        ({"min_operand": -1}, r"operands \[-1, 99\]"),
        ({"max_operand": 0}, "max_operand >= 1"),
    ],
)
def test_invalid_task(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ArithmeticTask(**kwargs)


def test_prompt_source_builds_the_task_from_data_config():
    data = DataConfig(
        task_min_operand=3, task_max_operand=12, task_ops="+-", task_template="Q: {a}{op}{b}"
    )
    source = prompt_source(data, seed=4)
    expected = ArithmeticTask(
        seed=4, max_operand=12, ops="+-", min_operand=3, template="Q: {a}{op}{b}"
    )
    assert source == expected
    assert source.batch(1, 6) == expected.batch(1, 6)
    assert prompt_source(DataConfig(), seed=0) == ArithmeticTask(seed=0)
    with pytest.raises(ConfigError, match="template"):
        prompt_source(DataConfig(task_template="{x}"), seed=0)


def test_prompt_source_reads_a_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"q{i}", "a": str(i)}) + "\n" for i in range(3)))
    data = DataConfig(
        path=str(path), prompt_field="q", answer_field="a", prompt_template="> {prompt}"
    )
    source = prompt_source(data, seed=1)
    assert isinstance(source, FileDataset)
    batch = source.batch(0, 3)
    assert sorted((e.prompt, e.answer) for e in batch) == [
        ("> q0", "0"),
        ("> q1", "1"),
        ("> q2", "2"),
    ]
