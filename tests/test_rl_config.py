"""`TrainConfig` as nested groups: YAML of the same shape, dotted flags, the flat names of flashrl 0.1
(refused, naming the new name), checkpoint configs, and the one dataclass-to-flags helper every
subcommand uses. Nothing here trains."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

import flashrl.rl.run
from flashrl.core.config import RolloutConfig
from flashrl.correction import CorrectionConfig
from flashrl.errors import CheckpointError, ConfigError
from flashrl.rl.checkpoint import config_differences
from flashrl.rl.config import RESUME_FREE_FIELDS, TrainConfig, field_names, group_classes
from flashrl.rl.config_build import build_config, stored_values
from flashrl.rl.plan import check_resume_config
from flashrl.rl.renamed import FLAT_RENAMED
from flashrl.rl.values import coerce
from flashrl.tools import args as flags
from flashrl.tools.cli import build_parser, main

# every flat field of flashrl 0.1's TrainConfig, with the value `flashrl train` wrote to config.yaml
# (refused everywhere now; the table of new names must cover them all)
FLAT_CONFIG = dict(
    model=None,
    data=None,
    prompt_field="question",
    answer_field="answer",
    prompt_template="{prompt}",
    chat_template=True,
    system_prompt=None,
    reward="exact_match",
    task_max_operand=9,
    task_ops="+",
    backend="builtin",
    rollout_quant="int8",
    rollout_config=None,
    rollout_dtype="bf16",
    kv_cache_dtype="bf16",
    lm_head_fp32=False,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    max_prompt_tokens=16,
    max_response_tokens=6,
    max_batch=256,
    vllm_kwargs=None,
    steps=200,
    batch_size=128,
    group_size=8,
    advantage="grpo",
    norm_adv_by_std=True,
    loss_aggregation="token_mean",
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    mini_batches=1,
    micro_batch_size=128,
    lr=3e-4,
    weight_decay=0.0,
    warmup_steps=0,
    grad_clip=1.0,
    kl_coef=0.0,
    overlong_buffer=0,
    overlong_penalty=1.0,
    dynamic_sampling=False,
    correction_mode="decoupled",
    correction="token_tis",
    tis_cap=2.0,
    correction_band=None,
    rejection=None,
    rejection_thresholds=None,
    device="cpu",
    trainer_dtype="fp32",
    seed=0,
    output_dir="runs/tiny-cpu",
    save_every=0,
    keep_last=None,
    resume=None,
    resume_allow_changes=None,
    overwrite=False,
    plot=True,
    compare=None,
)


@pytest.fixture
def no_training(monkeypatch):
    seen = []
    monkeypatch.setattr(flashrl.rl.run, "run", seen.append)
    return seen


def test_every_old_name_has_a_new_field():
    """The refusal messages name fields that exist (``rollout.file`` is a flag, not a field)."""
    assert set(FLAT_RENAMED) | {"model"} == set(FLAT_CONFIG)
    assert set(FLAT_RENAMED.values()) <= set(field_names()) | {"rollout.file"}
    assert len(set(FLAT_RENAMED.values())) == len(FLAT_RENAMED)  # one new name per old one


def test_yaml_of_the_nested_shape_round_trips(tmp_path):
    config = build_config(
        "tiny-cpu",
        None,
        {
            "correction.weight": "token_mis",
            "correction.band": "0.5_5.0",
            "rollout.skip": "lm_head,*.down_proj",
            "run.seed": "3",
        },
    )
    path = config.save_yaml(tmp_path / "c.yaml")
    text = yaml.safe_load(path.read_text())
    assert set(text) == {"model", "data", "rollout", "correction", "algo", "run"}
    assert text["correction"]["band"] == [0.5, 5.0] and text["rollout"]["skip"] == [
        "lm_head",
        "*.down_proj",
    ]
    assert build_config(None, str(path), {}) == config


def test_dotted_flags_reach_the_config(no_training, flashrl_logger):
    assert (
        main(
            [
                "train",
                "--correction.cap",
                "3",
                "--rollout.quant",
                "fp8",
                "--run.steps",
                "10",
                "--algo.dynamic-sampling",
                "--run.plot",
                "false",
                "--data.task-ops",
                "+-",
            ]
        )
        == 0
    )
    config = no_training[0]
    assert (config.correction.cap, config.rollout.quant, config.run.steps) == (3.0, "fp8", 10)
    assert (
        config.algo.dynamic_sampling is True
        and config.run.plot is False
        and config.data.task_ops == "+-"
    )
    assert config.algo.group_size == 8  # the preset's


def refused(capsys, argv):
    """`flashrl train ARGV` exits 2 with one error line and no traceback; returns the message."""
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashrl train: error: "), err
    assert "Traceback" not in err
    return lines[0].removeprefix("flashrl train: error: ")


def test_old_flat_flags_are_refused_naming_the_new_flags(no_training, flashrl_logger, capsys):
    message = refused(capsys, ["--tis-cap", "0", "--rollout-quant", "fp8", "--steps", "10"])
    assert message == (
        "--tis-cap was renamed: use --correction.cap; --tis-cap 0 is now --correction.weight "
        "none; --rollout-quant was renamed: use --rollout.quant; --steps was renamed: use "
        "--run.steps"
    )
    assert no_training == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "0.001"], "--lr was renamed: use --algo.lr"),
        (["--plot=false"], "--plot was renamed: use --run.plot"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype was renamed: use --rollout.kv-cache-dtype"),
        (["--data", "d.jsonl"], "--data was renamed: use --data.path"),
        (["--correction", "seq_tis"], "--correction was renamed: use --correction.weight"),
        (["--rollout_config", "f.yaml"], "--rollout_config was renamed: use --rollout.file"),
        (["--lr", "0.1", "--algo.lr", "0.2"], "--lr was renamed: use --algo.lr"),
    ],
)
def test_each_old_flag_is_one_clean_line(argv, message, no_training, flashrl_logger, capsys):
    assert refused(capsys, argv).startswith(message)
    assert no_training == []


def test_old_flat_yaml_keys_and_overrides_are_refused(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("steps: 7\nlr: 0.5\nrollout_quant: fp8\ncorrection: seq_tis\ndata: d.jsonl\n")
    with pytest.raises(ConfigError) as err:
        build_config("tiny-cpu", str(path), {})
    assert str(err.value) == (
        f"{path}: steps was renamed: use run.steps; lr was renamed: use algo.lr; rollout_quant "
        f"was renamed: use rollout.quant; correction was renamed: use correction.weight; data "
        f"was renamed: use data.path"
    )
    with pytest.raises(
        ConfigError, match=r"^overrides: max_batch was renamed: use rollout.max_batch$"
    ):
        build_config("tiny-cpu", None, {"max_batch": "4"})
    with pytest.raises(ConfigError, match="tis_cap was renamed: use correction.cap; tis_cap 0 is"):
        build_config("tiny-cpu", None, {"tis_cap": 0})
    path.write_text("run:\n  steps: 7\nalgo:\n  lr: 0.5\ndata:\n")  # the new spelling loads
    config = build_config("tiny-cpu", str(path), {"rollout.max_batch": "4"})
    assert (config.run.steps, config.algo.lr, config.rollout.max_batch) == (7, 0.5, 4)


def test_group_names_take_mappings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("correction: {weight: seq_tis, cap: 4}\ndata: {path: d.jsonl}\n")
    config = build_config(None, str(path), {})
    assert config.correction.weight == "seq_tis" and config.correction.cap == 4.0
    assert config.data.path == "d.jsonl"
    path.write_text("algo: 3\n")
    with pytest.raises(ConfigError, match="algo must be a mapping of AlgoConfig fields"):
        build_config(None, str(path), {})
    with pytest.raises(
        ConfigError, match=r"unknown config key\(s\) in overrides: algo.learning_rate"
    ):
        build_config(None, None, {"algo.learning_rate": "1"})


def test_rollout_file_is_the_base_of_the_rollout_group(tmp_path):
    path = RolloutConfig(quant="fp8_channel", kv_cache_dtype="fp8", lm_head_fp32=True).to_yaml(
        tmp_path / "r.yaml"
    )
    config = build_config(
        "tiny-cpu", None, {"rollout.file": str(path)}
    )  # the preset's int8 does not win
    assert config.rollout.as_rollout_config() == RolloutConfig(
        quant="fp8_channel", kv_cache_dtype="fp8", lm_head_fp32=True
    )
    # the engine fields are not in such a file: every layer sets them as usual
    engine = build_config("tiny-cpu", None, {"rollout.file": str(path), "rollout.dtype": "fp32"})
    assert engine.rollout.dtype == "fp32" and engine.rollout.quant == "fp8_channel"
    explicit = build_config(
        "tiny-cpu", None, {"rollout.file": str(path), "rollout.lm_head_fp32": "false"}
    )
    assert explicit.rollout.lm_head_fp32 is False and explicit.rollout.quant == "fp8_channel"
    with pytest.raises(FileNotFoundError, match="rollout.file"):
        build_config(None, None, {"rollout.file": str(tmp_path / "missing.yaml")})
    engine_keys = tmp_path / "engine.yaml"  # as refused by vLLM's FLASHRL_CONFIG
    engine_keys.write_text(path.read_text() + "dtype: fp32\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) dtype; allowed: quant, skip"):
        build_config("tiny-cpu", None, {"rollout.file": str(engine_keys)})


def test_checkpoint_configs_compare_and_an_old_flat_one_is_refused():
    current = build_config("tiny-cpu", None, {})
    free = set(RESUME_FREE_FIELDS)
    assert config_differences(stored_values(current.to_dict()), current.flat_dict(), free) == []
    changed = build_config(
        "tiny-cpu", None, {"run.seed": 3, "correction.weight": "none", "run.steps": 5}
    )
    diffs = config_differences(stored_values(current.to_dict()), changed.flat_dict(), free)
    assert diffs == [
        "correction.weight: 'token_tis' in the checkpoint, 'none' now",
        "run.seed: 0 in the checkpoint, 3 now",
    ]
    # a flat config is not translated: nothing under the new names would be compared
    with pytest.raises(CheckpointError, match=r"ckpt stores its config under old names"):
        check_resume_config(changed, Path("ckpt"), FLAT_CONFIG)
    with pytest.raises(CheckpointError, match="rollout_quant.*--run.resume-allow-changes all"):
        stored_values(FLAT_CONFIG)
    anyway = build_config(None, None, {"run.resume_allow_changes": "all"})
    check_resume_config(anyway, Path("ckpt"), FLAT_CONFIG)  # the comparison is skipped


def test_resume_allow_changes_takes_groups_and_refuses_old_names():
    def allowed(value):
        return build_config(None, None, {"run.resume_allow_changes": value}).resume_allowed()

    assert allowed("run.seed") == {"run.seed"}
    assert allowed("run.seed,rollout.quant") == {"run.seed", "rollout.quant"}
    assert allowed("correction") == {
        f"correction.{f.name}" for f in dataclasses.fields(CorrectionConfig)
    }
    assert allowed("all") is None
    with pytest.raises(ConfigError, match="unknown field.*run.sede"):
        allowed("run.sede")
    with pytest.raises(
        ConfigError,
        match=r"run.resume_allow_changes: seed was renamed: use run.seed; rollout_quant was "
        r"renamed: use rollout.quant$",
    ):
        allowed("seed,rollout_quant")


def test_validation_names_the_dotted_field():
    with pytest.raises(ConfigError, match="run.keep_last=0 is invalid; allowed: an integer >= 1"):
        build_config(None, None, {"run.keep_last": 0})
    with pytest.raises(ConfigError, match="correction.mode='bypass'.*algo.mini_batches=1"):
        build_config(
            None,
            None,
            {
                "correction.mode": "bypass",
                "algo.mini_batches": 2,
                "algo.batch_size": 16,
                "algo.group_size": 4,
            },
        )
    with pytest.raises(ConfigError, match="run.compare='int8,INT8' lists 'int8' twice"):
        TrainConfig(run=dataclasses.replace(TrainConfig().run, compare="int8,INT8"))


# ------------------------------------------------------------------------------------------------
# values and the dataclass-to-flags helper
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hint, value, expected",
    [
        (bool, "on", True),
        (bool, "OFF", False),
        (bool, True, True),
        (int, "10", 10),
        (float, 2, 2.0),
        (float | None, "none", None),
        (str, 0.01, "0.01"),
        (tuple[str, ...], "a, b,", ("a", "b")),
        (tuple[str, ...], ["a"], ("a",)),
        (str | float, "0.5", "0.5"),
        (str | float, 0.5, 0.5),
    ],
)
def test_coerce(hint, value, expected):
    assert coerce("x", hint, value) == expected


@pytest.mark.parametrize(
    "hint, value, message",
    [
        (bool, "maybe", "x='maybe' is not a boolean; expected true or false"),
        (int, "1.5", "x='1.5' is not an integer"),
        (int, True, "x=True is not an integer"),
        (float, "nan", r"x='nan' is not a number \(NaN\)"),
        (int, None, "x cannot be empty"),
        (float | None, "x", "expected a number or none"),
    ],
)
def test_coerce_errors(hint, value, message):
    with pytest.raises(ConfigError, match=message):
        coerce("x", hint, value, None)


@dataclasses.dataclass
class _Demo:
    """A demo."""

    required: str
    """Needed."""
    count: int = 3
    on: bool = False
    """A switch with 50 % more."""
    mode: bool | None = dataclasses.field(default=None, metadata={"words": {"auto": None}})
    documented: float = 1.0
    """from the docstring under the field
    (two lines)."""


def _parse(argv):
    parser = argparse.ArgumentParser(prog="demo", exit_on_error=False)
    flags.add_fields(parser, _Demo)
    return parser, parser.parse_args(argv)


def test_fields_become_flags_with_their_docs(capsys):
    parser, args = _parse(["--required", "r", "--on", "--mode", "auto"])
    assert flags.build(_Demo, args) == _Demo(required="r", on=True, mode=None)
    assert flags.build(
        _Demo, _parse(["--required", "r", "--on", "no", "--mode", "on", "--count", "4"])[1]
    ) == _Demo(required="r", count=4, on=False, mode=True)
    assert flags.field_docs(_Demo) == {
        "required": "Needed.",
        "on": "A switch with 50 % more.",
        "documented": "from the docstring under the field (two lines).",
    }
    parser.print_help()
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "--count INT (default: 3)" in help_text
        and "A switch with 50 % more. (default: false)" in help_text
    )
    with pytest.raises(ConfigError, match="--count='x' is not an integer"):
        flags.build(_Demo, _parse(["--required", "r", "--count", "x"])[1])


def test_every_subcommand_takes_its_flags_from_dataclasses():
    parser = build_parser()
    actions = {a.dest: a for a in parser._subparsers._group_actions[0].choices["bench"]._actions}
    assert {"batch", "random_weights", "decode_buckets", "threads", "hf"} <= set(actions)
    train = parser._subparsers._group_actions[0].choices["train"]
    dests = {a.dest for a in train._actions}
    assert set(field_names()) <= dests


@pytest.mark.parametrize(
    ("values", "warned"),
    [
        ({"rollout.quant": "bf16"}, True),  # bf16 rollouts, fp32 trainer, nearest: the lag
        ({"rollout.quant": "bf16", "rollout.sync_rounding": "stochastic"}, False),
        ({"rollout.quant": "bf16", "rollout.dtype": "fp32"}, False),
        ({"rollout.quant": "bf16", "run.trainer_dtype": "bf16"}, False),
        ({"rollout.quant": "int8"}, False),
    ],
)
def test_the_bf16_lag_is_warned_exactly_where_it_applies(values, warned):
    from flashrl.rl.config_checks import rounding_lag_warning

    message = rounding_lag_warning(TrainConfig().replace(values))
    assert (message is not None) == warned
    if warned:
        assert "--rollout.sync-rounding stochastic" in message and "rollout.dtype fp32" in message


def test_every_train_flag_has_help():
    """`flashrl train --help` explains every flag: each field of every TrainConfig group has a
    docstring (it is the flag's help)."""
    missing = [
        f"{group}.{f.name}"
        for group, cls in group_classes().items()
        for f in dataclasses.fields(cls)
        if f.name not in flags.field_docs(cls)
    ]
    assert missing == []
