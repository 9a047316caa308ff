"""`flashrl generate` and `flashrl bench` through `flashrl.tools.cli.main`, on a tiny checkpoint loaded by the
real loader: what they print and write is checked against the engine itself.

Tolerance: logprobs printed by `generate` equal `Engine.score` of the same tokens to 1e-5 (fp32 engine;
the sampled path and the no-cache forward sum in different orders)."""

from __future__ import annotations

import json

import pytest

from flashrl.core.env import ENV_VARS
from flashrl.engine import Engine, EngineConfig
from flashrl.tools.cli import main

PROMPTS = ("5,9,17,33", "40,41")


@pytest.fixture(autouse=True)
def _restore_logger(flashrl_logger, monkeypatch):
    """main() configures the `flashrl` logger and reads FLASHRL_*: keep both out of other tests."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def generate_args(path, *extra):
    args = [
        "generate",
        "--model",
        str(path),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--n",
        "2",
        "--seed",
        "3",
        "--max-tokens",
        "6",
        "--ignore-eos",
    ]
    for ids in PROMPTS:
        args += ["--prompt-ids", ids]
    return args + list(extra)


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_generate_json_logprobs_equal_engine_scoring(scheme, tiny_models, capsys):
    path = tiny_models("qwen2")
    assert main(generate_args(path, "--quant", scheme, "--json")) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    scorer = Engine(path, scheme, EngineConfig(dtype="fp32", device="cpu", progress=False))
    for r in rows:
        prompt = [int(t) for t in PROMPTS[r["prompt_index"]].split(",")]
        assert len(r["response_ids"]) == len(r["logprobs"]) == 6 and r["finish_reason"] == "length"
        ref = scorer.score(prompt, r["response_ids"], temperature=0.7, top_k=20, top_p=0.9)
        assert max(abs(a - b) for a, b in zip(r["logprobs"], ref)) < 1e-5


def test_generate_text_output_lists_every_token_with_its_logprob(tiny_models, capsys):
    path = tiny_models("qwen2")
    assert main(generate_args(path, "--json")) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(generate_args(path, "--logprobs")) == 0
    lines = capsys.readouterr().out.splitlines()
    headers = [k for k, line in enumerate(lines) if line.startswith("[prompt ")]
    assert len(headers) == 4 and "(length, 6 tokens, quant=bf16)" in lines[0]
    for row, k in zip(rows, headers):
        token_lines = lines[k + 2 : k + 2 + 6]  # header, the ids (no tokenizer), one line per token
        assert lines[k + 1].split() == [str(t) for t in row["response_ids"]]
        assert [int(line.split()[0]) for line in token_lines] == row["response_ids"]
        assert [float(line.split()[-1]) for line in token_lines] == pytest.approx(
            row["logprobs"], abs=1e-6
        )


def test_bench_cli_prints_the_table_and_writes_json(tiny_models, tmp_path, capsys):
    path, out = tiny_models("qwen2"), tmp_path / "bench.json"
    args = [
        "bench",
        "--model",
        str(path),
        "--quant",
        "bf16,int8",
        "--batch",
        "3",
        "--prompt-len",
        "5",
        "--output-len",
        "4",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--max-prefill-tokens",
        "10",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "tokens_per_s" in printed and "vs_first" in printed and f"wrote {out}" in printed
    result = json.loads(out.read_text())
    rows = {r["scheme"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "int8"} and result["rows"][0]["scheme"] == "bf16"
    assert result["rows"][0]["vs_first"] == 1.0
    assert rows["int8"]["vs_first"] == pytest.approx(
        rows["int8"]["tokens_per_s"] / rows["bf16"]["tokens_per_s"]
    )
    for row in rows.values():
        assert (
            row["tokens"] == 3 * 4 and row["decode_steps"] == 3
        )  # the first token comes from the prefill
        assert row["prefill_forwards"] == 2  # 10 padded tokens per forward: 5-token prompts 2 + 1
        assert row["tokens_per_s"] > 0 and row["ttft_s"] > 0 and row["requantize_s"] > 0
        assert 0 < row["vs_floor"]
    assert result["config"]["max_prefill_tokens"] == 10 and result["device"]


def test_bench_cli_rejects_unknown_schemes(tiny_models, capsys):
    assert (
        main(["bench", "--model", str(tiny_models("qwen2")), "--quant", "bf16,int9", "--out", ""])
        == 2
    )
    err = capsys.readouterr().err
    assert "int9" in err and "fp8_channel" in err


def test_bench_random_weights_with_transformers_row(tmp_path, capsys):
    """`--random-weights` builds the engine and the `transformers` model from the named dimensions, with
    nothing downloaded or saved; both generate exactly batch x output-len tokens."""
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--random-weights",
        "tiny-bench",
        "--quant",
        "int8",
        "--batch",
        "2",
        "--prompt-len",
        "4",
        "--output-len",
        "3",
        "--device",
        "cpu",
        "--hf",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["scheme"] for r in rows] == ["int8", "transformers"]
    assert all(r["tokens"] == 2 * 3 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["weight_gib"] > 0 and rows[1]["vs_first"] == pytest.approx(
        rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    )
