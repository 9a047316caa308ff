"""Bad inputs to the built-in engine give one typed error naming what was wrong and what is allowed:
config files (`ConfigError`), damaged checkpoints (`CheckpointError`), bad tensors (`WeightError`),
sampling parameters and prompts (`InputError`), devices that are not there (`UnsupportedError`)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrl.engine import SamplingParams
from flashrl.errors import CheckpointError, ConfigError, InputError, UnsupportedError, WeightError
from shorthand import build_engine


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    kwargs.setdefault("max_len", 64)
    return build_engine(path, **kwargs)


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    """A writable copy of the tiny qwen2 checkpoint (with tokenizer) to damage."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_models("qwen2", tokenizer=True), dst)
    return dst


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path / "config.json"


def named(path) -> str:
    return re.escape(str(path))


# ------------------------------------------------------------------------------------------ config.json


@pytest.mark.parametrize("content", ["[1, 2]", "3", '"qwen2"', "null"])
def test_config_that_is_not_an_object(model_copy, content):
    (model_copy / "config.json").write_text(content)
    with pytest.raises(
        ConfigError, match=named(model_copy / "config.json") + ".*must be a JSON object"
    ):
        engine(model_copy)


def test_config_that_is_not_json(model_copy):
    (model_copy / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match=named(model_copy / "config.json") + ".*not valid JSON"):
        engine(model_copy)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(hidden_size="64"), r"hidden_size='64' is invalid; allowed: an integer in \[1, "),
        (
            dict(num_attention_heads=0),
            r"num_attention_heads=0 is invalid; allowed: an integer in \[1, ",
        ),
        (dict(vocab_size=-1), r"vocab_size=-1 is invalid; allowed: an integer in \[1, "),
        (
            dict(vocab_size=1e12),
            r"vocab_size=1000000000000\.0 is invalid; allowed: an integer in \[1, ",
        ),
        (
            dict(vocab_size=10**12),
            r"vocab_size=1000000000000 is invalid; allowed: an integer in \[1, 16777216\]",
        ),
        (dict(num_hidden_layers=True), r"num_hidden_layers=True is invalid; allowed: an integer"),
        (dict(intermediate_size=None), r"intermediate_size=None is invalid; allowed: an integer"),
        (dict(rms_norm_eps="x"), r"rms_norm_eps='x' is invalid; allowed: a number in \(0, 1\)"),
        (dict(rms_norm_eps=0), r"rms_norm_eps=0 is invalid"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
            r"rope_theta=-1\.0 is invalid; allowed: a fin",
        ),
        (
            dict(rope_parameters=None, rope_theta="1e4"),
            r"rope_theta='1e4' is invalid; allowed: a finite number > 0",
        ),
        (dict(max_position_embeddings=0), r"max_position_embeddings=0 is invalid"),
        (
            dict(num_key_value_heads=3),
            r"num_key_value_heads=3 is invalid; allowed: a divisor of num_attention_heads=4",
        ),
        (
            dict(hidden_size=66),
            r"hidden_size=66 is invalid; allowed: a multiple of num_attention_heads=4",
        ),
        (dict(head_dim=15), r"head_dim=15 is invalid; allowed: an even integer"),
        (
            dict(tie_word_embeddings="yes"),
            r"tie_word_embeddings='yes' is invalid; allowed: true or false",
        ),
        (
            dict(eos_token_id="2"),
            r"eos_token_id='2' is invalid; allowed: a token id \(an integer >= 0\), a list of them",
        ),
        (dict(eos_token_id=[2, -1]), r"eos_token_id=\[2, -1\] is invalid"),
        (
            dict(bos_token_id=[1]),
            r"bos_token_id=\[1\] is invalid; allowed: a token id \(an integer >= 0\) or null",
        ),
        (
            dict(architectures="Qwen2ForCausalLM"),
            r"architectures='Qwen2ForCausalLM' is invalid; allowed: a list",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
            r"rope_parameters: 'low_freq_factor' is missing \(rope type 'llama3' needs it\)",
        ),
        (
            dict(rope_parameters=None, rope_scaling={"rope_type": "linear", "factor": "2"}),
            r"rope_scaling: factor='2' is invalid; allowed: a finite number > 0",
        ),
        (
            dict(rope_parameters=None, rope_scaling=[2.0]),
            r"rope_scaling=\[2\.0\] is invalid; allowed: an object or null",
        ),
    ],
)
def test_config_values_are_checked(model_copy, changes, message):
    config = edit_config(model_copy, **changes)
    with pytest.raises(ConfigError, match=named(config) + ": " + message):
        engine(model_copy)


def test_max_len_beyond_the_model(model_copy):
    edit_config(model_copy, max_position_embeddings=128)
    with pytest.raises(ConfigError, match=r"max_len=256 .*max_position_embeddings=128"):
        engine(model_copy, max_len=256)
    for bad in (0, -5, 2.5, "64", True):
        with pytest.raises(
            ConfigError, match=rf"max_len={re.escape(repr(bad))} is invalid; allowed: an integer"
        ):
            engine(model_copy, max_len=bad)
    assert engine(model_copy, max_len=128).max_len == 128


# ------------------------------------------------------------------------------------------ other model files


def test_generation_config_that_is_not_json(model_copy):
    (model_copy / "generation_config.json").write_text("{eos: 2}")
    with pytest.raises(
        ConfigError, match=named(model_copy / "generation_config.json") + ".*not valid JSON"
    ):
        engine(model_copy)
    (model_copy / "generation_config.json").write_text('{"eos_token_id": "2"}')
    with pytest.raises(
        ConfigError, match=named(model_copy / "generation_config.json") + ".*eos_token_id='2'"
    ):
        engine(model_copy)


def test_tokenizer_that_is_not_json(model_copy):
    (model_copy / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(
        CheckpointError, match=named(model_copy / "tokenizer.json") + ".*not valid JSON"
    ):
        engine(model_copy)


def test_shard_index_that_is_not_json(model_copy):
    (model_copy / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(
        CheckpointError,
        match=named(model_copy / "model.safetensors.index.json") + ".*not valid JSON",
    ):
        engine(model_copy)
    (model_copy / "model.safetensors.index.json").write_text(
        '{"weight_map": ["model.safetensors"]}'
    )
    with pytest.raises(
        CheckpointError, match=named(model_copy / "model.safetensors.index.json") + ".*weight_map"
    ):
        engine(model_copy)


@pytest.mark.parametrize("damage", ["truncated", "empty", "not safetensors", "header only"])
def test_damaged_weight_file(model_copy, damage):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "not safetensors": b"\x89PNG\r\n" + data[:100],
        "header only": data[:12],
    }[damage]
    weights.write_bytes(damaged)
    with pytest.raises(
        CheckpointError, match=named(weights) + " is not a readable safetensors file"
    ):
        engine(model_copy)


@pytest.mark.parametrize(
    "dtype,value,message",
    [
        (torch.int32, 1, r"has dtype torch\.int32; allowed: float32, bfloat16, float16 or float64"),
        (torch.float32, float("nan"), r"contains 1 non-finite value\(s\) \(NaN or Inf\)"),
        (torch.float32, float("inf"), r"contains 1 non-finite value\(s\) \(NaN or Inf\)"),
    ],
)
def test_bad_tensor_in_checkpoint(model_copy, dtype, value, message):
    weights = model_copy / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.1.mlp.up_proj.weight"
    bad = tensors[name].to(dtype)
    bad[3, 5] = value
    tensors[name] = bad
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        WeightError, match=named(weights) + ": tensor " + re.escape(repr(name)) + ".*" + message
    ):
        engine(model_copy)


# ------------------------------------------------------------------------------------------ sampling parameters


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature="1.0"), r"temperature='1\.0' is invalid; allowed: a number >= 0"),
        (dict(temperature=float("nan")), r"temperature=nan is invalid"),
        (dict(temperature=float("inf")), r"temperature=inf is invalid"),
        (dict(temperature=None), r"temperature=None is invalid"),
        (dict(top_p="0.9"), r"top_p='0\.9' is invalid; allowed: a number in \(0, 1\]"),
        (dict(top_k=2.5), r"top_k=2\.5 is invalid; allowed: an integer >= 0"),
        (dict(top_k=True), r"top_k=True is invalid; allowed: an integer"),
        (dict(n=2.0), r"n=2\.0 is invalid; allowed: an integer >= 1"),
        (dict(n=True), r"n=True is invalid"),
        (dict(max_tokens=16.0), r"max_tokens=16\.0 is invalid; allowed: an integer >= 1"),
        (dict(seed="abc"), r"seed='abc' is invalid; allowed: an integer or None"),
        (dict(seed=1.5), r"seed=1\.5 is invalid"),
        (dict(seed=False), r"seed=False is invalid"),
        (dict(ignore_eos="no"), r"ignore_eos='no' is invalid; allowed: True or False"),
        (dict(logprobs=1), r"logprobs=1 is invalid; allowed: True or False"),
        (dict(raw_logprobs=None), r"raw_logprobs=None is invalid"),
        (
            dict(stop_token_ids=[2.5]),
            r"stop_token_ids=\[2\.5\] is invalid; allowed: a list of token ids \(integers >= 0\)",
        ),
        (dict(stop_token_ids=[-1]), r"stop_token_ids=\[-1\] is invalid"),
        (dict(stop_token_ids=5), r"stop_token_ids=5 is invalid"),
        (dict(stop_token_ids="ab"), r"stop_token_ids='ab' is invalid"),
    ],
)
def test_sampling_params_types(kwargs, message):
    with pytest.raises(InputError, match=r"SamplingParams\." + message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_numbers_of_any_numeric_type():
    p = SamplingParams(
        temperature=1,
        top_p=np.float32(0.5),
        top_k=np.int64(3),
        n=np.int32(2),
        seed=np.int64(7),
        stop_token_ids=np.array([5, 6]),
        max_tokens=8,
    )
    assert (p.temperature, p.top_p, p.top_k, p.n, p.seed, p.stop_token_ids) == (
        1.0,
        0.5,
        3,
        2,
        7,
        (5, 6),
    )
    assert (
        type(p.temperature) is float
        and type(p.top_k) is int
        and type(p.n) is int
        and type(p.seed) is int
    )
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(
        stop_token_ids=torch.tensor([4])
    ).stop_token_ids == (4,)


# ------------------------------------------------------------------------------------------ prompts


def test_prompt_errors(tiny_models):
    e = engine(tiny_models("qwen2"))
    with pytest.raises(InputError, match=r"generate needs at least one prompt"):
        e.generate([])
    for prompt, message in [
        (
            [5, 6.0],
            r"prompt 0: token id 6\.0 at position 1 is not an integer; allowed: integers in \[0, 256\)",
        ),
        ([5, 6.7], r"prompt 0: token id 6\.7 at position 1"),
        ([5, True], r"prompt 0: token id True at position 1"),
        ([5, "6"], r"prompt 0: token id '6' at position 1"),
        (
            torch.tensor([5.0, 6.0]),
            r"prompt 0 is a tensor of dtype torch\.float32 and shape \(2,\); allowed: an int",
        ),
        (np.array([5.0, 6.0]), r"prompt 0: token id 5\.0 at position 0"),
        (7, r"prompt 0 is int; allowed: a string or a list of token ids"),
    ]:
        with pytest.raises(InputError, match=message):
            e.generate([prompt], SamplingParams(max_tokens=2))
    with pytest.raises(
        InputError, match=r"stop_token_ids \[300\] are outside the vocabulary \[0, 256\)"
    ):
        e.generate([[5, 6]], SamplingParams(max_tokens=2, stop_token_ids=[5, 300]))
    with pytest.raises(
        InputError, match=r"prompt 0 is a tensor of dtype torch\.int64 and shape \(\)"
    ):
        e.generate(torch.tensor([5, 6]))  # a batch of prompts, not one prompt
    with pytest.raises(InputError, match=r"generate params must be a SamplingParams, got dict"):
        e.generate([[5, 6]], {"temperature": 0})
    for ok in ([5, 6], torch.tensor([5, 6]), np.array([5, 6]), (5, 6)):
        assert e.generate([ok], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[
            0
        ].prompt_ids == [5, 6]


def test_score_and_logits_check_token_ids(tiny_models):
    e = engine(tiny_models("qwen2"))
    with pytest.raises(InputError, match=r"response 0: token id 2\.5 at position 0"):
        e.score([5, 6], [2.5])
    with pytest.raises(
        InputError,
        match=r"response 0: token id 300 at position 1 is outside the vocabulary; allowed: integers in \[0, 256\)",
    ):
        e.score([5, 6], [7, 300])
    with pytest.raises(InputError, match=r"sequence: token id 1\.5 at position 0"):
        e.logits([1.5, 2])
    with pytest.raises(
        InputError, match=r"sequence: token id -1 at position 1 is outside the vocabulary"
    ):
        e.logits([1, -1])


# ------------------------------------------------------------------------------------------ device


def test_device_that_is_not_there(tiny_models):
    path = tiny_models("qwen2")
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    with pytest.raises(UnsupportedError, match=rf"device={missing!r}: CUDA .* available.*cpu"):
        engine(path, device=missing)
    with pytest.raises(ConfigError, match=r"device='gpu0' is invalid; allowed: cpu, cuda, cuda:N"):
        engine(path, device="gpu0")
    assert engine(path, device=torch.device("cpu")).device == torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_batch=0), r"max_batch=0 is invalid; allowed: an integer >= 1"),
        (dict(max_batch="4"), r"max_batch='4' is invalid"),
        (dict(max_batch=2, kv_cache_memory=2**20), r"give max_batch or kv_cache_memory, not both"),
        (
            dict(kv_cache_memory=-1),
            r"kv_cache_memory=-1 is out of range; allowed: a number of bytes >= 1",
        ),
        (dict(dtype="int8"), r"dtype 'int8' is invalid; allowed: bf16"),
        (dict(max_prefill_tokens=0), r"max_prefill_tokens=0 is invalid; allowed: an integer >= 1"),
        (
            dict(kv_scale_granularity="head"),
            r"kv_scale_granularity applies to kv_cache_dtype='fp8' only",
        ),
        (
            dict(kv_cache_dtype="fp8", kv_scale="dynamic", kv_scale_granularity="head"),
            r"does not apply to kv_scale='dyn",
        ),
        (dict(decode_compile="fast"), r"decode_compile='fast' is invalid"),
    ],
)
def test_engine_options_are_config_errors(tiny_models, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        engine(tiny_models("qwen2"), **kwargs)
