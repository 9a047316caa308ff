"""No code runs from a model folder: `check_no_custom_code` refuses a folder that asks for it.

A Hugging Face folder asks `transformers` to import Python code shipped beside the weights through
an ``auto_map`` entry (``"AutoConfig": "configuration_x.XConfig"``) in ``config.json`` or
``tokenizer_config.json``. Depending on the entry and the terminal, `transformers` then runs that
code, asks "do you wish to run the custom code?" or fails with a traceback. flashrl never runs such
code: every ``from_pretrained`` it calls passes ``trust_remote_code=False`` explicitly
(`NO_REMOTE_CODE`), and before that, each folder is checked here and refused with a
`ConfigError` that names the file, the ``auto_map`` entry and the code file it points at. Loading
the folder with transformers' built-in classes instead would silently give another model than the
custom code describes, so a folder with an ``auto_map`` is refused even when its ``model_type``
is one transformers knows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flashrl.errors import ConfigError

NO_REMOTE_CODE = {"trust_remote_code": False}
"""Keyword arguments of every `transformers` / vLLM entry point flashrl calls on a model folder."""

AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")
"""The files of a model folder whose ``auto_map`` makes `transformers` import code."""


def check_no_custom_code(*model_dirs: str | Path) -> None:
    """Raise a `ConfigError` when a folder in `model_dirs` asks for custom code: an ``auto_map``
    entry in its ``config.json`` or ``tokenizer_config.json``. A missing or unreadable file passes
    here (the loader that reads it names the problem); nothing in the folder is imported."""
    for model_dir in model_dirs:
        for name in AUTO_MAP_FILES:
            path = Path(model_dir) / name
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError):  # missing, a directory, not JSON: the loader names it
                continue
            check_auto_map(raw, path)


def check_auto_map(raw: Any, path: Path, name: str | None = None) -> None:
    """Raise a `ConfigError` when `raw`, the parsed JSON of `path`, has an ``auto_map`` entry
    (`name`: how the error names the file, by default its path)."""
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    if not auto_map:  # absent, null or empty: no code asked for
        return
    if not isinstance(auto_map, dict):
        auto_map = {"auto_map": auto_map}
    raise ConfigError(_message(path, auto_map, name or str(path)))


def check_trust_remote_code(kwargs: dict[str, Any], source: str) -> None:
    """Refuse ``trust_remote_code`` set to anything but false in user-given loader arguments
    (`source` names where they came from, e.g. ``rollout.backend_kwargs``)."""
    value = kwargs.get("trust_remote_code", False)
    if value is not False:
        raise ConfigError(
            f"{source}: trust_remote_code={value!r} is not allowed; flashrl never runs code from a "
            f"model folder (allowed: false or leave it out)"
        )


def _message(path: Path, auto_map: dict[str, Any], name: str) -> str:
    key, value = next(iter(auto_map.items()))
    more = f" (and {len(auto_map) - 1} more)" if len(auto_map) > 1 else ""
    return (
        f"{name}: auto_map entry {key!r}: {value!r}{more} asks to run custom code "
        f"({_code_files(path.parent, value)}); flashrl never runs code from a model folder "
        f"(trust_remote_code=False). Allowed: a model folder without auto_map, whose architecture "
        f"transformers supports with its own code; if the built-in class is the same model, "
        f"delete auto_map from {path.name}"
    )


def _code_files(folder: Path, value: Any) -> str:
    """Where the code of an ``auto_map`` value lives: ``module.Class`` is ``folder/module.py``,
    ``repo--module.Class`` is ``module.py`` of the Hub repository ``repo``; a list (a slow and a
    fast tokenizer) names each."""
    refs = [v for v in value if isinstance(v, str)] if isinstance(value, list) else [value]
    files = []
    for ref in refs:
        if not isinstance(ref, str) or "." not in ref:
            files.append(f"unreadable reference {ref!r}")
            continue
        repo, _, ref = ref.rpartition("--")
        module = ref.rsplit(".", 1)[0].replace(".", "/") + ".py"
        files.append(f"{module} of the Hub repository {repo}" if repo else str(folder / module))
    return ", ".join(files) or "no file named"
