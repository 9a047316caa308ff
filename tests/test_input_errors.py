"""Bad inputs outside the CLI raise flashrl's typed errors (which `flashrl` prints as one line), naming what
was wrong; plain ValueError / TypeError stay for bugs. See tests/test_cli_errors.py for the command line."""

from __future__ import annotations

import json

import pytest
import torch

from flashrl.errors import ConfigError, InputError, UnsupportedError
from flashrl.rl.data import FileDataset, read_rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("d.json", "{oops", "d.json: not valid JSON"),
        ("d.jsonl", b"\xff\xfe\n", "d.jsonl: not UTF-8 text"),
        ("d.jsonl", '"just a string"\n', "row 1 is a str; expected an object"),
        (
            "d.jsonl",
            '{"question": "q", "answer": "a"}\n{"question": "q2"}\n',
            r"row 2 has no field\(s\) 'answer'",
        ),
        ("d.parquet", "not parquet", "d.parquet: not a readable parquet file"),
    ],
)
def test_bad_dataset_files_are_input_errors(tmp_path, name, content, message):
    """Every bad dataset file is an InputError naming the file (the CLI prints it as one line)."""
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputError, match=message):
        FileDataset(str(path))
    with pytest.raises(InputError, match="is a directory"):
        read_rows(tmp_path)


def test_bad_prompt_templates_are_config_errors(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    for template in ("{prompt} {other}", "{prompt} {", "no placeholder"):
        with pytest.raises(ConfigError, match="prompt_template"):
            FileDataset(str(path), prompt_template=template)


def test_settings_errors_are_config_errors():
    from flashrl.correction import CorrectionConfig
    from flashrl.quant.schemes import get_scheme, parse_scheme_list
    from flashrl.rl.algo import group_advantages
    from flashrl.rl.loss import ppo_clip_loss
    from flashrl.rl.rewards import get_reward

    with pytest.raises(ConfigError, match="unknown quantization scheme 'int4'"):
        get_scheme("int4")
    with pytest.raises(ConfigError, match="empty scheme list"):
        parse_scheme_list(" , ")
    with pytest.raises(ConfigError, match="unknown reward 'f1'"):
        get_reward("f1")
    with pytest.raises(ConfigError, match="advantage estimator 'ppo'"):
        group_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ConfigError, match="unknown CorrectionConfig keys"):
        CorrectionConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match="CorrectionConfig.cap='x' is not a number"):
        CorrectionConfig.from_dict({"cap": "x"})
    lp = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="aggregation='mean'"):
        ppo_clip_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), aggregation="mean")


def test_tensor_errors_are_input_errors():
    from flashrl.quant.dispatch import quantize_weight
    from flashrl.quant.schemes import get_scheme

    w = torch.randn(8, 8)
    w[1, 2] = float("nan")
    with pytest.raises(InputError, match=r"w: tensor contains 1 non-finite value\(s\)"):
        quantize_weight(w, get_scheme("int8"), name="w")
    with pytest.raises(InputError, match="must be 2-D"):
        quantize_weight(torch.randn(8), get_scheme("int8"), name="w")


def test_kernel_environment_errors(monkeypatch):
    from flashrl.quant import kernels

    monkeypatch.setenv("FLASHRL_QUANT_KERNELS", "cuda")
    with pytest.raises(ConfigError, match="FLASHRL_QUANT_KERNELS='cuda' is not a kernel mode"):
        kernels.get_mode()
    monkeypatch.setenv("FLASHRL_QUANT_KERNELS", "triton")
    if kernels.unsupported_reason(torch.zeros(2, 2)) is not None:
        with pytest.raises(UnsupportedError) as err:
            kernels.use_triton(torch.zeros(2, 2))
        assert isinstance(err.value, RuntimeError)  # the type it had before


def test_profile_and_bench_input_files(tmp_path):
    from flashrl.tools.bench import random_model_dir
    from flashrl.tools.calibration_prompts import read_prompts_file
    from flashrl.tools.setup import load_profile

    with pytest.raises(InputError, match="is a directory"):
        read_prompts_file(tmp_path)
    with pytest.raises(InputError, match="is a directory"):
        load_profile(tmp_path)
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"\xff\xfe\n")
    with pytest.raises(InputError, match="p.txt: not UTF-8 text"):
        read_prompts_file(bad)
    config = tmp_path / "config.json"
    for text, message in [
        ("{oops", "not a JSON file"),
        ("[1]", "expected a Hugging Face config.json"),
    ]:
        config.write_text(text)
        with pytest.raises(InputError, match=message):
            random_model_dir(str(config), tmp_path / "m")
