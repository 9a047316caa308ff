"""Prompt sources and reward functions."""

from __future__ import annotations

import json

import pytest

from flashrl.rl.data import ArithmeticTask, FileDataset, read_rows, render_prompt
from flashrl.rl.rewards import (
    exact_match,
    extract_number,
    get_reward,
    gold_answer,
    math_verify,
    numeric,
)


def test_arithmetic_task_is_a_pure_function_of_step():
    task = ArithmeticTask(seed=3, max_operand=9, ops="+-*")
    assert task.batch(5, 8) == task.batch(5, 8)
    assert task.batch(5, 8) != task.batch(6, 8)
    for ex in task.batch(0, 200):
        a, op, b = ex.prompt[0], ex.prompt[1], ex.prompt[2:-1]
        assert ex.answer == str(eval(f"{a}{op}{b}")) and int(ex.answer) >= 0
    with pytest.raises(ValueError, match="ops='/'"):
        ArithmeticTask(ops="/")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_file_dataset_epochs_and_fields(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)]
    data = FileDataset(
        str(write_jsonl(tmp_path / "d.jsonl", rows)), seed=1, prompt_template="Q: {prompt}"
    )
    seen = [ex.prompt for step in range(5) for ex in data.batch(step, 2)]
    assert sorted(seen[:5]) == [f"Q: q{i}" for i in range(5)]  # one full epoch before repeating
    assert data.batch(3, 2) == data.batch(3, 2)


def test_parquet_dataset(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"problem": ["1+1"], "solution": ["2"]}), tmp_path / "d.parquet")
    data = FileDataset(str(tmp_path / "d.parquet"), prompt_field="problem", answer_field="solution")
    assert data.batch(0, 1)[0].prompt == "1+1"


def test_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FileDataset(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "target": "y"}])
    with pytest.raises(
        ValueError, match=r"no field\(s\) 'question', 'answer'; fields found: prompt, target"
    ):
        FileDataset(str(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        read_rows(bad)
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        (tmp_path / "d.csv").write_text("a,b\n")
        read_rows(tmp_path / "d.csv")


def test_render_prompt_uses_the_chat_template():
    from flashrl.testing import char_tokenizer

    tok = char_tokenizer()
    assert render_prompt(tok, "1+1=") == "1+1="  # no template: the text itself
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    assert render_prompt(tok, "1+1=", system="s") == "<system>s<user>1+1=<a>"
    assert render_prompt(tok, "1+1=", use_chat_template=False) == "1+1="


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("The total is 1,234 dollars. #### 1,234", "work... #### 1234", 1.0),
        ("so \\boxed{42}", "#### 42", 1.0),
        ("first 3 then 41", "41", 1.0),
        ("#### 41 and later 42", "#### 42", 0.0),
        ("no number", "#### 7", 0.0),
        ("$18.00", "#### 18", 1.0),
    ],
)
def test_numeric_reward(response, answer, expected):
    assert numeric(response, answer) == expected


def test_exact_match_and_gold_answer():
    assert gold_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert exact_match(" 17 ", "17") == 1.0 and exact_match("17.", "17") == 0.0
    assert extract_number("x = -3.5") == -3.5


def test_math_verify_reward():
    assert math_verify("Thus \\boxed{\\frac{1}{2}}", "#### 0.5") == 1.0
    assert math_verify("\\boxed{3}", "#### 4") == 0.0
    with pytest.raises(ValueError, match="allowed: exact_match, numeric, math_verify"):
        get_reward("f1")
