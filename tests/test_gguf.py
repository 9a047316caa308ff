"""GGUF conversion without a real model: finding the file, checking it, atomic output, the cache key
and the `flashrl convert` error path (the loader itself is monkeypatched out)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flashrl.errors import ConfigError, InputError, UnsupportedError
from flashrl.model import gguf as gguf_mod
from flashrl.model.gguf import (
    cached_conversion,
    check_gguf,
    convert_gguf,
    find_gguf,
    is_gguf_path,
)
from flashrl.tools.cli import main


def write_gguf(path: Path, arch: str) -> Path:
    """A tiny valid GGUF file: `general.architecture` = `arch` and one 4x4 F32 tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("blk.0.attn_q.weight", np.arange(16, dtype=np.float32).reshape(4, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_gguf(path: Path, payload: bytes = b"payload") -> Path:
    """A file `find_gguf` accepts (it only reads the magic)."""
    path.write_bytes(b"GGUF" + payload)
    return path


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------------ find_gguf


def test_find_gguf_accepts_a_file_and_a_folder_with_one(tmp_path):
    path = fake_gguf(tmp_path / "m.gguf")
    (tmp_path / "notes.txt").write_text("x")
    assert find_gguf(path) == path
    assert find_gguf(str(tmp_path)) == path


def test_find_gguf_rejects_a_file_without_the_magic(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGML" + b"\0" * 16)
    with pytest.raises(InputError, match="not a GGUF file"):
        find_gguf(path)


def test_find_gguf_folder_with_two_files_lists_both(tmp_path):
    fake_gguf(tmp_path / "a.gguf")
    fake_gguf(tmp_path / "b.gguf")
    with pytest.raises(ConfigError, match="exactly one") as info:
        find_gguf(tmp_path)
    assert "a.gguf" in str(info.value) and "b.gguf" in str(info.value)


def test_find_gguf_folder_with_none(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"found: none"):
        find_gguf(tmp_path)


def test_find_gguf_unknown_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the name is not a path relative to the working directory
    with pytest.raises(FileNotFoundError, match="neither a file, a folder nor an installed"):
        find_gguf("no_such_package_flashrl_xyz")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_gguf(tmp_path / "missing.gguf")


def test_is_gguf_path():
    assert is_gguf_path("m.gguf") and is_gguf_path(Path("/x/M.GGUF"))
    assert not is_gguf_path(None)
    assert not is_gguf_path("builtin:tiny") and not is_gguf_path("/x/gguf")


# ------------------------------------------------------------------------------------ check_gguf


def test_check_gguf_names_an_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "bogusarch")
    with pytest.raises(UnsupportedError, match="'bogusarch' is not supported") as info:
        check_gguf(path)
    supported = str(info.value).split("supported:")[-1]
    assert "llama" in supported and "qwen2" in supported


def test_check_gguf_returns_architecture_and_types(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    assert check_gguf(path) == ("llama", {"F32": 1})


def test_check_gguf_rejects_a_truncated_file(tmp_path):
    path = fake_gguf(tmp_path / "m.gguf", b"\x03\x00")
    with pytest.raises(InputError, match="not a readable GGUF file"):
        check_gguf(path)


# ------------------------------------------------------------------------------------ convert_gguf


@pytest.fixture
def quick_check(monkeypatch):
    """`check_gguf` without reading the file."""
    monkeypatch.setattr(gguf_mod, "check_gguf", lambda path: ("llama", {"F32": 1}))


def test_convert_refuses_an_existing_output(tmp_path):
    src = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ConfigError, match="already exists"):
        convert_gguf(src, out)
    assert listing(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "old"


def test_convert_refuses_a_missing_parent_a_bad_dtype_and_a_file(tmp_path):
    src = fake_gguf(tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="does not exist"):
        convert_gguf(src, tmp_path / "nope" / "out")
    with pytest.raises(ConfigError, match=r"dtype='int3' is invalid; allowed: bf16, fp16, fp32"):
        convert_gguf(src, tmp_path / "out", dtype="int3")
    assert not (tmp_path / "nope").exists() and not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        convert_gguf(src, tmp_path / "file", overwrite=True)
    assert (tmp_path / "file").read_text() == "x"


def test_convert_failure_leaves_no_output_and_no_temp(tmp_path, monkeypatch, quick_check):
    src = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    seen = []

    def fail(path, tmp, dtype, bar):
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        seen.append(tmp)
        raise RuntimeError("loader exploded")

    monkeypatch.setattr(gguf_mod, "_write_folder", fail)
    with pytest.raises(RuntimeError, match="loader exploded"):
        convert_gguf(src, out)
    assert seen and seen[0].parent == tmp_path and seen[0].name.startswith(".out.tmp")
    assert not out.exists()
    assert listing(tmp_path) == ["m.gguf"]  # no .out.tmp* left behind


def test_overwrite_keeps_the_old_output_when_the_write_fails(tmp_path, monkeypatch, quick_check):
    src = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("old")

    def fail(path, tmp, dtype, bar):
        tmp.mkdir()
        (tmp / "config.json").write_text("new")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_mod, "_write_folder", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(src, out, overwrite=True)
    assert listing(out) == ["config.json"] and (out / "config.json").read_text() == "old"
    assert listing(tmp_path) == ["m.gguf", "out"]


def test_overwrite_replaces_the_output(tmp_path, monkeypatch, quick_check):
    src = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    dtypes = []

    def write(path, tmp, dtype, bar):
        tmp.mkdir()
        (tmp / "config.json").write_text("new")
        dtypes.append(dtype)

    monkeypatch.setattr(gguf_mod, "_write_folder", write)
    assert convert_gguf(src, out, dtype="fp16", overwrite=True) == out
    assert dtypes == ["fp16"]
    assert listing(out) == ["config.json"] and (out / "config.json").read_text() == "new"
    assert listing(tmp_path) == ["m.gguf", "out"]  # neither .out.tmp* nor .out.old* is left


# ------------------------------------------------------------------------------------ cache


def test_cached_conversion_keys_on_the_file_content(tmp_path, monkeypatch):
    calls = []

    def convert(source, out, dtype="bf16", overwrite=False):
        out = Path(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"placeholder")
        calls.append((Path(source), out.name, dtype))
        return out

    monkeypatch.setattr(gguf_mod, "convert_gguf", convert)
    src = fake_gguf(tmp_path / "m.gguf", b"one")
    cache = tmp_path / "cache"
    first = cached_conversion(src, cache)
    assert first.parent == cache / "gguf" and first.name.startswith("m-")
    assert first.name.endswith("-bf16") and len(calls) == 1
    assert cached_conversion(src, cache) == first and len(calls) == 1  # converted once
    fake_gguf(src, b"two")  # same name, other bytes: a new key
    second = cached_conversion(src, cache)
    assert second != first and second.name.startswith("m-") and len(calls) == 2
    assert cached_conversion(src, cache, dtype="fp32").name.endswith("-fp32") and len(calls) == 3


# ------------------------------------------------------------------------------------ CLI


def test_cli_convert_missing_file_is_one_error_line(tmp_path, capsys, flashrl_logger):
    assert main(["convert", "/nonexistent.gguf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashrl convert: error: ")
    assert "/nonexistent.gguf" in err[0]
    assert not (tmp_path / "out").exists()
