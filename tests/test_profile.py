"""`flashrl profile` / `flashrl setup`: documented JSON fields, an outlier layer flagged and skipped
(with a lower mismatch after skipping), setup round-trips into a config the engine applies, and
clear errors for bad input.

The outlier model: a tiny Qwen2 (sharp logits: initializer_range 0.2) whose layer-1 attention
input channel 7 is zeroed by its norm weight while column 7 of `k_proj` holds a weight 30x the
largest: the column never contributes to the output, but it sets every row's int8 scale, so the
other weights of `k_proj` are rounded on a 30x coarser grid. fp8 keeps 3 mantissa bits at any
magnitude, so only int8 should flag it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrl.core.config import RolloutConfig, resolve_config
from flashrl.core.env import from_env
from flashrl.engine import Engine, EngineConfig
from flashrl.model.config import ModelConfig
from flashrl.quant.linear import DEFAULT_SKIP, DenseLinear, QuantLinear
from flashrl.testing import save_tiny_model
from flashrl.tools.cli import main
from flashrl.tools.profile import (
    DEFAULT_THRESHOLD,
    SCHEMA_VERSION,
    ProfileConfig,
    run_profile,
)
from flashrl.tools.profile_engines import calibrate, make_engine
from flashrl.tools.profile_metrics import distribution_mismatch, recommend_skip, shard_names
from flashrl.tools.profile_report import recommended_mismatch
from flashrl.tools.setup import build_setup, load_profile, run_setup

OUTLIER_LAYER = "model.layers.1.self_attn.qkv_proj"
OUTLIER_NAMES = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]

# The documented JSON fields (docs/profile.md).
TOP_LEVEL = {
    "schema_version",
    "flashrl_version",
    "created",
    "model",
    "device",
    "device_name",
    "dtype",
    "settings",
    "calibration",
    "layers",
    "baseline",
    "schemes",
    "kv_cache",
    "timings_s",
}
MODEL = {"path", "family", "num_layers", "hidden_size", "vocab_size", "tie_word_embeddings"}
SETTINGS = {
    "schemes",
    "threshold",
    "kv_cache_dtype",
    "lm_head_fp32",
    "seed",
    "max_prompt_tokens",
    "max_new_tokens",
    "temperature",
    "smooth",
}
CALIBRATION = {
    "source",
    "file",
    "num_sequences",
    "prompt_tokens",
    "response_tokens",
    "positions",
    "note",
}
LAYER = {
    "name",
    "engine_layer",
    "shape",
    "tokens",
    "weight_amax_ratio",
    "input_amax_ratio",
    "errors",
}
SCHEME = {
    "output_error_median",
    "output_error_max",
    "flagged",
    "skip_trials",
    "recommended_skip",
    "skip",
    "mismatch",
    "mismatch_after_skip",
    "memory",
    "smoothing",
    "recommended_smooth",
    "mismatch_after_smooth",
}
MEMORY = {
    "weight_bytes_bf16",
    "weight_bytes",
    "weight_bytes_after_skip",
    "ratio",
    "ratio_after_skip",
}
EXACT = {
    "kl",
    "kl_max",
    "reverse_kl",
    "tv",
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "top1_agreement",
    "positions",
}
SAMPLED = {
    "kl",
    "k3_kl",
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "token_mult_prob_error",
    "tokens",
}


def save_outlier_model(path, factor: float = 30.0):
    path = save_tiny_model(path, "qwen2", seed=0, tokenizer=True, initializer_range=0.2)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.input_layernorm.weight"][7] = 0.0
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    k[:, 7] = k.abs().max() * factor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    return save_outlier_model(tmp_path_factory.mktemp("outlier"))


@pytest.fixture(scope="module")
def profiled(outlier_model, tmp_path_factory):
    """`flashrl profile --quant int8,fp8` through the CLI: (model dir, profile path, parsed JSON, stdout)."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(
            [
                "profile",
                "--model",
                str(outlier_model),
                "--quant",
                "int8,fp8",
                "--device",
                "cpu",
                "--max-new-tokens",
                "24",
                "--out",
                str(out),
            ]
        )
    assert code == 0, buffer.getvalue()
    return outlier_model, out, json.loads(out.read_text()), buffer.getvalue()


# ------------------------------------------------------------------------------------------------
# the profile
# ------------------------------------------------------------------------------------------------


def test_json_has_the_documented_fields(profiled):
    model, path, doc, _ = profiled
    json.loads(
        path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}")
    )
    assert set(doc) == TOP_LEVEL
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    assert (
        set(doc["model"]) == MODEL
        and doc["model"]["family"] == "qwen2"
        and doc["model"]["num_layers"] == 2
    )
    assert set(doc["settings"]) == SETTINGS
    assert (
        doc["settings"]["schemes"] == ["int8", "fp8"]
        and doc["settings"]["threshold"] == DEFAULT_THRESHOLD
    )
    assert set(doc["calibration"]) == CALIBRATION and doc["calibration"]["source"] == "builtin"
    assert doc["calibration"]["num_sequences"] == 16 and doc["calibration"]["response_tokens"] > 0
    assert doc["kv_cache"] is None
    assert SAMPLED <= set(doc["baseline"]["sampled"]) and doc["baseline"]["decode_tok_s"] > 0
    # one layer entry per linear tensor of the checkpoint, in HF names
    expected = sorted(
        n.removesuffix(".weight")
        for n in load_file(model / "model.safetensors")
        if n.endswith("_proj.weight")
    )
    assert sorted(e["name"] for e in doc["layers"]) == expected
    for entry in doc["layers"]:
        assert set(entry) == LAYER and set(entry["errors"]) == {"int8", "fp8"}
        assert entry["tokens"] == doc["calibration"]["positions"]
        for errors in entry["errors"].values():
            assert set(errors) == {"weight_error", "output_error"}
            assert 0 < errors["weight_error"] < 1 and 0 < errors["output_error"] < 1
    for scheme in ("int8", "fp8"):
        entry = doc["schemes"][scheme]
        assert set(entry) == SCHEME and set(entry["memory"]) == MEMORY
        assert (
            set(entry["mismatch"]) == {"exact", "sampled", "kv_cache", "decode_tok_s"}
            and entry["mismatch"]["kv_cache"] is None
        )
        assert entry["mismatch"]["decode_tok_s"] > 0
        assert set(entry["mismatch"]["exact"]) == EXACT and SAMPLED <= set(
            entry["mismatch"]["sampled"]
        )
        assert entry["mismatch"]["exact"]["positions"] == doc["calibration"]["positions"]


def test_outlier_layer_is_flagged_and_skipping_it_lowers_the_mismatch(profiled):
    _, _, doc, stdout = profiled
    int8 = doc["schemes"]["int8"]
    errors = {e["name"]: e["errors"]["int8"]["output_error"] for e in doc["layers"]}
    assert errors["model.layers.1.self_attn.k_proj"] > 2 * DEFAULT_THRESHOLD
    assert all(
        err < DEFAULT_THRESHOLD / 2
        for name, err in errors.items()
        if name != "model.layers.1.self_attn.k_proj"
    )
    assert [f["engine_layer"] for f in int8["flagged"]] == [OUTLIER_LAYER]
    assert (
        int8["flagged"][0]["names"] == OUTLIER_NAMES
    )  # the whole fused layer: it runs as one GEMM
    assert int8["recommended_skip"] == OUTLIER_NAMES
    trial = int8["skip_trials"][0]  # tried end to end: it lowered the KL, so it was kept
    assert trial["names"] == OUTLIER_NAMES and trial["kept"]
    assert trial["kl"] < int8["mismatch"]["exact"]["kl"]
    assert int8["skip"] == list(DEFAULT_SKIP) + OUTLIER_NAMES
    before, after = int8["mismatch"]["exact"], int8["mismatch_after_skip"]["exact"]
    assert after["kl"] < before["kl"] / 3, (before, after)
    assert after["kl_max"] < before["kl_max"] and after["top1_agreement"] > before["top1_agreement"]
    memory = int8["memory"]
    assert memory["weight_bytes"] < memory["weight_bytes_after_skip"] < memory["weight_bytes_bf16"]
    assert memory["ratio"] == pytest.approx(memory["weight_bytes"] / memory["weight_bytes_bf16"])
    # fp8 keeps relative precision at any magnitude: nothing to skip
    fp8 = doc["schemes"]["fp8"]
    assert (
        fp8["flagged"] == []
        and fp8["skip_trials"] == []
        and fp8["recommended_skip"] == []
        and fp8["mismatch_after_skip"] is None
    )
    assert fp8["skip"] == list(DEFAULT_SKIP)
    assert fp8["memory"]["weight_bytes_after_skip"] == fp8["memory"]["weight_bytes"]
    # the table names the layer and both mismatch rows
    assert "model.layers.1.self_attn.k_proj" in stdout and "*" in stdout
    names = ", ".join(OUTLIER_NAMES)
    assert (
        f"int8: keep 3 tensor(s) in bf16: {names} (1 flagged layer(s) tried end to end)" in stdout
    )
    assert "int8 + 3 tensor(s) kept in bf16" in stdout
    assert "fp8: no layer above the threshold" in stdout


def test_smoothing_is_tried_end_to_end_and_recommended_only_if_it_lowers_the_kl(profiled):
    _, path, doc, stdout = profiled
    assert doc["settings"]["smooth"] == 0.5
    for scheme in ("int8", "fp8"):
        entry = doc["schemes"][scheme]
        trial, best = entry["smoothing"], (entry["mismatch_after_skip"] or entry["mismatch"])
        assert trial["alpha"] == 0.5 and trial["reason"] is None and math.isfinite(trial["kl"])
        assert trial["kept"] == (trial["kl"] < best["exact"]["kl"])
        assert entry["recommended_smooth"] == (0.5 if trial["kept"] else None)
        assert (entry["mismatch_after_smooth"] is not None) == trial["kept"]
        if trial["kept"]:
            assert entry["mismatch_after_smooth"]["exact"]["kl"] == trial["kl"]
        config, header = build_setup(load_profile(path), quant=scheme)
        assert config.smooth == entry["recommended_smooth"]
        assert "online smoothing (a = 0.5) on top of that skip list: exact KL" in header
    assert "smoothing a = 0.5: KL" in stdout


def test_smoothing_is_recommended_where_activation_outliers_hurt(tmp_path):
    """Outlier input channels (the norms before q/k/v and gate/up scaled 60x in one channel):
    per-token int8 loses the other channels, smoothing moves the outlier into the weights."""
    path = save_tiny_model(tmp_path, "qwen2", seed=0, tokenizer=True, initializer_range=0.2)
    tensors = load_file(path / "model.safetensors")
    for layer in range(2):
        tensors[f"model.layers.{layer}.input_layernorm.weight"][7] *= 60
        tensors[f"model.layers.{layer}.post_attention_layernorm.weight"][11] *= 60
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    doc = run_profile(ProfileConfig(model=str(path), quant="int8", device="cpu", max_new_tokens=16))
    entry = doc.schemes["int8"]
    assert entry.recommended_smooth == 0.5
    assert entry.smoothing["kl"] < entry.mismatch["exact"]["kl"] / 2  # measured: 0.026 vs 0.084
    none = run_profile(
        ProfileConfig(model=str(path), quant="int8", device="cpu", max_new_tokens=16, smooth=None)
    )
    assert (
        none.schemes["int8"].smoothing is None and none.schemes["int8"].recommended_smooth is None
    )


def test_threshold_controls_the_recommendation(profiled):
    _, _, doc, _ = profiled
    assert recommend_skip(doc["layers"], "int8", 10.0) == []
    everything = recommend_skip(doc["layers"], "int8", 1e-9)
    assert len(everything) == 2 * 4  # qkv, o, gate_up, down per layer
    assert everything[0]["engine_layer"] == OUTLIER_LAYER  # worst first
    assert sorted(n for f in everything for n in f["names"]) == sorted(
        e["name"] for e in doc["layers"]
    )


def test_long_tables_show_the_worst_tensors(profiled, monkeypatch):
    _, _, doc, _ = profiled
    monkeypatch.setattr("flashrl.tools.profile_report.MAX_TABLE_LAYERS", 3)
    from flashrl.tools.profile_report import format_profile

    text = format_profile(doc)
    assert "the 3 worst of 14 tensors" in text
    table = [line for line in text.splitlines() if line.startswith("| model.layers.")]
    assert len(table) == 3 and any("layers.1.self_attn.k_proj" in line for line in table)


def test_shard_names():
    assert shard_names("layers.3.self_attn.qkv_proj", 3) == [
        f"model.layers.3.self_attn.{p}_proj" for p in "qkv"
    ]
    assert shard_names("layers.0.mlp.gate_up_proj", 2) == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
    ]
    assert shard_names("layers.1.mlp.down_proj", 1) == ["model.layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="has 2 shard"):
        shard_names("layers.1.mlp.down_proj", 2)


# ------------------------------------------------------------------------------------------------
# setup -> config -> engine
# ------------------------------------------------------------------------------------------------


def assert_engine_skips_outlier_layer(engine: Engine) -> None:
    layers = engine.model.layers
    assert isinstance(layers[1].self_attn.qkv_proj, DenseLinear)
    for layer in layers:
        for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(module, QuantLinear) and module.scheme.name == "int8"
    assert isinstance(layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(engine.model.lm_head, DenseLinear)


def test_setup_round_trips_into_a_config_the_engine_applies(
    profiled, tmp_path, monkeypatch, capsys
):
    model, profile_path, doc, _ = profiled
    out = tmp_path / "flashrl.yaml"
    assert (
        main(["setup", "--profile", str(profile_path), "--quant", "int8", "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "skip model.layers.1.self_attn.k_proj" in printed
    text = out.read_text()
    assert text.startswith("# flashrl rollout config written by `flashrl setup`")
    assert "with this skip list" in text and str(profile_path) in text
    config = RolloutConfig.from_yaml(out)
    assert config == RolloutConfig(
        quant="int8",
        skip=tuple(doc["schemes"]["int8"]["skip"]),
        kv_cache_dtype="bf16",
        kv_scale="calibrated",
        lm_head_fp32=False,
        logprobs_mode="processed",
        smooth=doc["schemes"]["int8"]["recommended_smooth"],
    )
    assert resolve_config(str(out)) == config  # what `flashrl train`'s rollout.file uses
    cpu = EngineConfig(device="cpu", progress=False, max_len=64)
    assert_engine_skips_outlier_layer(Engine(model, rollout_config=str(out), engine_config=cpu))
    monkeypatch.setenv("FLASHRL_CONFIG", str(out))
    assert from_env() == config
    assert_engine_skips_outlier_layer(Engine(model, engine_config=cpu))


def test_setup_picks_the_scheme_and_rederives_the_skip_list(profiled):
    _, _, doc, _ = profiled
    with pytest.raises(
        ValueError, match=r"profiles 2 schemes \(int8, fp8\); choose one with --quant"
    ):
        build_setup(doc)
    with pytest.raises(
        ValueError, match="--quant 'fp8_block' was not profiled in profile; allowed: int8, fp8"
    ):
        build_setup(doc, quant="fp8_block")
    fp8, _ = build_setup(doc, quant="FP8")
    assert fp8.quant == "fp8" and fp8.skip == DEFAULT_SKIP
    loose, header = build_setup(doc, quant="int8", threshold=10.0)
    assert loose.skip == DEFAULT_SKIP and "was not measured" in header
    strict, _ = build_setup(doc, quant="int8", threshold=0.001)
    assert len(strict.skip) == len(DEFAULT_SKIP) + len(doc["layers"])
    with pytest.raises(ValueError, match="--threshold -1"):
        build_setup(doc, quant="int8", threshold=-1)


def test_setup_single_scheme_needs_no_quant(profiled):
    _, _, doc, _ = profiled
    single = json.loads(json.dumps(doc))
    single["settings"]["schemes"] = ["int8"]
    del single["schemes"]["fp8"]
    config, _ = build_setup(single)
    assert config.quant == "int8" and config.skip == tuple(doc["schemes"]["int8"]["skip"])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("schema_version"), "missing field 'schema_version'"),
        (lambda d: d.update(schema_version=7), "schema_version 7 is not supported"),
        (lambda d: d["settings"].pop("kv_cache_dtype"), "missing field 'settings.kv_cache_dtype'"),
        (
            lambda d: d["settings"].update(lm_head_fp32="no"),
            "field 'settings.lm_head_fp32' has type str; expected bool",
        ),
        (lambda d: d["settings"].update(schemes=["int4"]), "unknown scheme 'int4'"),
        (lambda d: d["schemes"]["fp8"].pop("skip"), "missing field 'schemes.fp8.skip'"),
        (
            lambda d: d["layers"][3]["errors"].pop("int8"),
            r"layers\[3\]: missing field 'errors.int8.output_error'",
        ),
        (
            lambda d: d["schemes"]["int8"].update(skip=["lm_head", ""]),
            "non-empty module-name patterns",
        ),
    ],
)
def test_bad_profile_files_name_the_culprit(profiled, tmp_path, edit, message, capsys):
    _, _, doc, _ = profiled
    bad = json.loads(json.dumps(doc))
    edit(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert (
        main(
            ["setup", "--profile", str(path), "--quant", "int8", "--out", str(tmp_path / "x.yaml")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("flashrl setup: error:") and "bad.json" in err
    with pytest.raises(ValueError, match=message):
        run_setup(path, tmp_path / "x.yaml", quant="int8")


def test_setup_file_errors(tmp_path, capsys):
    assert (
        main(["setup", "--profile", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.yaml")])
        == 2
    )
    assert "--profile: file" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match="garbage.json: not a JSON file"):
        load_profile(garbage)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def test_prompts_files_and_random_ids(outlier_model, tiny_models, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("1+1=\n\n2+3=\nabc\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('"7*6="\n{"prompt": "hello"}\n{"text": "world"}\n')
    common = dict(model=str(outlier_model), quant="int8", device="cpu", max_new_tokens=4)
    doc = run_profile(ProfileConfig(prompts=str(text), **common)).to_dict()
    assert doc["calibration"]["source"] == "file" and doc["calibration"]["num_sequences"] == 3
    assert run_profile(ProfileConfig(prompts=str(jsonl), **common)).calibration.num_sequences == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"question": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON string or an object"):
        run_profile(ProfileConfig(prompts=str(bad), **common))
    bad.write_text('"ok"\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        run_profile(ProfileConfig(prompts=str(bad), **common))
    with pytest.raises(FileNotFoundError, match="--prompts: file"):
        run_profile(ProfileConfig(prompts=str(tmp_path / "missing.txt"), **common))
    no_tokenizer = tiny_models("qwen2")
    doc = run_profile(
        ProfileConfig(
            model=str(no_tokenizer),
            quant="fp8_block",
            device="cpu",
            max_new_tokens=4,
            max_prompt_tokens=16,
        )
    ).to_dict()
    assert (
        doc["calibration"]["source"] == "random_token_ids"
        and "no tokenizer" in doc["calibration"]["note"]
    )
    assert (
        doc["settings"]["max_prompt_tokens"] == 16
        and doc["calibration"]["prompt_tokens"] <= 16 * 16
    )
    with pytest.raises(ValueError, match="has no tokenizer, so text prompts cannot be encoded"):
        run_profile(
            ProfileConfig(model=str(no_tokenizer), prompts=str(text), quant="int8", device="cpu")
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model"], "model directory '/nonexistent/model' does not exist"),
        (
            ["--quant", "int4"],
            "unknown quantization scheme 'int4'; allowed: bf16, int8, fp8, fp8_channel, fp8_block",
        ),
        (["--quant", "bf16,int8"], "bf16 is the reference"),
        (["--quant", "int8,int8"], "names a scheme twice"),
        (["--threshold", "0"], "--threshold 0.0 is invalid"),
        (["--out", "/nonexistent/dir/p.json"], "--out /nonexistent/dir/p.json: directory"),
    ],
)
def test_profile_cli_errors(tiny_models, argv, message, capsys):
    args = {"--model": str(tiny_models("qwen2")), "--quant": "int8", "--out": "profile.json"}
    for flag, value in zip(argv[::2], argv[1::2]):
        args[flag] = value
    assert main(["profile", *[x for kv in args.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


MISMATCH_KEYS = ("mismatch", "mismatch_after_skip", "mismatch_after_smooth")


def test_kv_cache_dtype_fp8(outlier_model):
    cfg = ProfileConfig(
        model=str(outlier_model), quant="int8", device="cpu", kv_cache_dtype="fp8", max_new_tokens=8
    )
    doc = run_profile(cfg).to_dict()
    kv = doc["kv_cache"]
    assert kv["dtype"] == "fp8" and kv["kv_scale"] == "calibrated"
    assert kv["bytes_per_token"] < kv["bytes_per_token_bf16"]
    assert set(kv["kv_only"]) == {"kv_cache"}  # teacher-forced only: no third decode pass
    assert kv["kv_only"]["kv_cache"]["kl"] > 0 and kv["kv_only"]["kv_cache"]["tokens"] > 0
    int8 = doc["schemes"]["int8"]  # the KV cache is measured once, on the recommended config
    measured = [k for k in MISMATCH_KEYS if int8[k] is not None and int8[k]["kv_cache"] is not None]
    assert [int8[k] for k in measured] == [recommended_mismatch(int8)]
    assert recommended_mismatch(int8)["kv_cache"]["kl"] > 0
    config, _ = build_setup(doc)
    assert config.kv_cache_dtype == "fp8" and config.kv_scale == "calibrated"


def test_lm_head_fp32_is_profiled_and_written(outlier_model, tmp_path):
    doc = run_profile(
        ProfileConfig(
            model=str(outlier_model),
            quant="fp8_channel",
            device="cpu",
            lm_head_fp32=True,
            max_new_tokens=4,
        )
    ).to_dict()
    assert doc["settings"]["lm_head_fp32"] is True
    config, _ = build_setup(doc)
    assert config.lm_head_fp32 is True and config.quant == "fp8_channel"
    assert doc["schemes"]["fp8_channel"]["memory"]["weight_bytes_bf16"] > 0
    assert torch.isfinite(torch.tensor(doc["schemes"]["fp8_channel"]["mismatch"]["exact"]["kl"]))


def test_skip_selection_follows_the_end_to_end_kl_not_the_layer_error():
    """A layer whose error is the largest but whose bf16 restoration raises the end-to-end KL is
    not recommended (as q/k/v on SmolLM2-135M with int8); the others are kept one by one while
    each lowers the KL, so the recommendation never raises it."""
    from flashrl.tools.profile_select import select_skips

    flagged = [
        {"names": ["l0.q", "l0.k", "l0.v"], "output_error": 0.5},
        {"names": ["l3.down"], "output_error": 0.3},
        {"names": ["l5.v"], "output_error": 0.2},
        {"names": ["l7.o"], "output_error": 0.15},
    ]
    effect = {"l0.q": +0.02, "l3.down": -0.01, "l5.v": -0.005, "l7.o": +0.001}
    calls = []

    def kl_of(names):
        calls.append(list(names))
        return 0.036 + sum(effect.get(n, 0.0) for n in names)

    chosen, trace = select_skips(flagged, kl_of, base_kl=0.036, progress=False)
    assert chosen == ["l3.down", "l5.v"]
    assert [t["kept"] for t in trace] == [False, True, True, False]
    assert calls[1] == ["l3.down"] and calls[3] == ["l3.down", "l5.v", "l7.o"]
    assert kl_of(chosen) <= 0.036
    assert select_skips(flagged, lambda names: 1.0, base_kl=0.5, progress=False)[0] == []


def test_progress_names_each_stage(outlier_model, capsys):
    """A profile takes minutes on a real model: a bar on stderr ticks per stage and names it."""
    doc = run_profile(ProfileConfig(model=str(outlier_model), quant="int8", device="cpu",
                                    max_new_tokens=8, kv_cache_dtype="fp8"))  # fmt: skip
    err = capsys.readouterr().err
    for label in ("bf16 responses", "per-layer errors", "int8 end to end", "int8 skip list",
                  "int8 smoothing", "int8 + fp8 KV cache", "bf16 weights + fp8 KV cache"):  # fmt: skip
        assert label in err, label
    assert "7/7" in err
    assert len(doc.timings_s) == 7 and all(t >= 0 for t in doc.timings_s.values())
    assert next(iter(doc.timings_s)) == "bf16 responses"  # the stages, in order, in the JSON
    run_profile(ProfileConfig(model=str(outlier_model), quant="int8", device="cpu",
                              max_new_tokens=8, progress=False, smooth=None))  # fmt: skip
    assert "profile" not in capsys.readouterr().err


def test_schemes_are_ranked_by_the_recommended_configs_kl_with_their_speed(profiled):
    _, _, doc, stdout = profiled
    kls = {s: recommended_mismatch(doc["schemes"][s])["exact"]["kl"] for s in ("int8", "fp8")}
    order = sorted(kls, key=kls.get)
    line = next(x for x in stdout.splitlines() if x.startswith("lowest mismatch first"))
    assert line.index(f"{order[0]} (KL") < line.index(f"{order[1]} (KL"), line
    base = doc["baseline"]["decode_tok_s"]
    speed = recommended_mismatch(doc["schemes"]["int8"])["decode_tok_s"] / base
    assert f"{speed:.2f}x bf16 decode" in line
    assert "decode tok/s" in stdout and "vs bf16" in stdout


def test_cached_reference_logits_give_the_same_exact_mismatch(outlier_model):
    """`Calibration.exact` reuses the reference's logits across engines: the numbers are those of a
    fresh reference forward per engine, bit for bit."""
    cfg = ProfileConfig(model=str(outlier_model), device="cpu", max_new_tokens=8, progress=False)
    cal, _ = calibrate(cfg, ModelConfig.from_model_dir(outlier_model))
    cal.prompts, cal.rollouts = cal.prompts[:4], cal.rollouts[:4]
    engine = make_engine(cfg, "int8", DEFAULT_SKIP, cal.max_len)
    first, again = cal.exact(engine), cal.exact(engine)  # the second reads the cache
    fresh = distribution_mismatch(cal.reference, engine, cal.sequences, cfg.temperature)
    assert first == again == fresh
    assert first["kl"] > 0
