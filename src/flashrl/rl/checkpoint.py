"""A training run on disk: its directory, checkpoints and metrics, written so that a crash at any
moment leaves a state `flashrl train --run.resume latest` can continue from, and read without
running any code from the files.

Layout of `output_dir`: `metrics.jsonl` (one JSON object per step, appended), `config.yaml`, and
`checkpoint-<step>/` directories (HF weights as safetensors, tokenizer, `trainer_state.pt`).

- A checkpoint is written to `.checkpoint-<step>.tmp/`, every file fsynced, then renamed into place:
  a `checkpoint-<step>/` directory is complete. Leftover `.tmp` directories are incomplete writes
  and are deleted on the next start.
- `trainer_state.pt` holds only tensors and plain containers and is loaded with
  ``torch.load(weights_only=True)``: a planted pickle is refused, never run.
- Metrics lines are appended with one write + fsync each, so a crash tears at most the last line;
  resume drops a torn last line (warning) and rewrites the file with temp file + fsync + rename.
- `manifest.json`, written last into each checkpoint, records every file's size and SHA-256
  (`flashrl.rl.manifest`): flipped bytes that leave a file parseable are still found on resume.
- A damaged checkpoint is a `CheckpointError` naming the file; `--run.resume latest` falls back to
  the newest complete one and renames the damaged ones to `checkpoint-<step>.damaged`.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashrl.errors import CheckpointError, ConfigError
from flashrl.fileio import atomic_write_text, fsync_dir, fsync_tree
from flashrl.rl.durable import disk_full_message, tree_bytes
from flashrl.rl.manifest import check_manifest, write_manifest
from flashrl.rl.metric_names import upgrade_row

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
RUN_OUTPUTS = ("metrics.jsonl", "samples.jsonl", "config.yaml", "curves.png")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_DAMAGED = re.compile(r"checkpoint-(\d+)\.damaged")
_PARTIAL = re.compile(r"\.checkpoint-(\d+)\.(tmp|old)")


# ------------------------------------------------------------------ the checkpoint directory


def write_checkpoint_dir(path: Path, write: Callable[[Path], None]) -> Path:
    """Create directory `path` atomically: `write(tmp)` fills `.<name>.tmp`, every file is fsynced,
    then the directory is renamed to `path` (an existing `path` is moved aside first and deleted
    after)."""
    tmp, aside = path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        write_manifest(tmp)  # last: the size and SHA-256 of every file, checked on resume
        fsync_tree(tmp)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        written = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        previous = [p for _, p in list_checkpoints(path.parent) if p != path]
        message = disk_full_message(path, written, previous[-1] if previous else None)
        raise CheckpointError(message) from None
    if path.exists():
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)
    return path


# ------------------------------------------------------------------ the run directory


def check_output_dir(output_dir: str | Path) -> Path:
    """`output_dir` as a Path; ConfigError if it, or a directory above it, is an existing file."""
    path = Path(output_dir)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            what = "" if part == path else f": {str(part)!r}"
            raise ConfigError(
                f"run.output_dir={str(path)!r}{what} is a file; allowed: a directory "
                f"(new or existing)"
            )
    return path


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every `checkpoint-<step>` directory, oldest first (other names are
    ignored)."""
    found = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = _CHECKPOINT.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def run_files(output_dir: Path) -> list[Path]:
    """The files and directories of a run in `output_dir` (metrics, config, plots, checkpoints)."""
    if not output_dir.is_dir():
        return []
    return sorted(
        p
        for p in output_dir.iterdir()
        if p.name in RUN_OUTPUTS
        or any(r.fullmatch(p.name) for r in (_CHECKPOINT, _DAMAGED, _PARTIAL))
    )


def holds_run(output_dir: Path) -> list[str]:
    """Names of what makes `output_dir` hold a run: metrics.jsonl and checkpoint directories."""
    metrics = [METRICS_FILE] if (output_dir / METRICS_FILE).is_file() else []
    damaged = [p.name for p in run_files(output_dir) if _DAMAGED.fullmatch(p.name)]
    return metrics + [p.name for _, p in list_checkpoints(output_dir)] + damaged


def remove(paths: list[Path], why: str) -> None:
    for p in paths:
        logger.warning("deleting %s (%s)", p, why)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def refuse_existing_run(output_dir: Path, overwrite: bool) -> None:
    """For a fresh run: CheckpointError if `output_dir` holds a run, unless `overwrite` (then it is
    deleted)."""
    found = holds_run(output_dir)
    if not found:
        return
    if not overwrite:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise CheckpointError(
            f"output_dir {str(output_dir)!r} already holds a run ({shown}); "
            f"continue it with --run.resume latest, delete it with --run.overwrite "
            f"true, or choose another --run.output-dir"
        )
    remove(run_files(output_dir), "--run.overwrite: a fresh run replaces the run in this directory")


def clean_partial_writes(output_dir: Path) -> None:
    """Delete `.checkpoint-N.tmp` (incomplete writes); put back a `.checkpoint-N.old` whose
    replacement never landed (a crash between the two renames), else delete it."""
    for p in run_files(output_dir):
        m = _PARTIAL.fullmatch(p.name)
        if not m:
            continue
        final = output_dir / f"checkpoint-{m.group(1)}"
        if m.group(2) == "old" and not final.exists():
            logger.warning("restoring %s from %s (its replacement was interrupted)", final, p)
            p.rename(final)
        else:
            remove([p], "an interrupted checkpoint write")


def prune_checkpoints(output_dir: Path, keep_last: int | None) -> None:
    """Delete all but the `keep_last` newest checkpoints (call only after the newest is in
    place)."""
    if keep_last is None:
        return
    old = [p for _, p in list_checkpoints(output_dir)[:-keep_last]]
    remove(old, f"keep_last={keep_last}")


# ------------------------------------------------------------------ checkpoint contents


def trainer_state(
    step: int, optimizer: torch.optim.Optimizer, config: dict[str, Any]
) -> dict[str, Any]:
    """What `trainer_state.pt` holds: tensors and plain containers only (loadable with
    weights_only)."""
    version, internal, gauss = random.getstate()
    return dict(
        step=step,
        optimizer=optimizer.state_dict(),
        config=config,
        python_rng=[version, list(internal), gauss],
        torch_rng=torch.get_rng_state(),
    )


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_rng"])


def load_state(path: Path) -> dict[str, Any]:
    """Load `trainer_state.pt` without running code from it; CheckpointError naming the file
    otherwise."""
    file = path / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; not a flashrl checkpoint")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # damaged zip, truncated file, or a pickle that needs code to load
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(
            f"{file}: damaged or not a flashrl trainer state, refused ({reason}); only tensors "
            f"and plain containers are loaded (weights_only), never code"
        ) from None
    expected = dict(
        step=int, optimizer=dict, config=dict, python_rng=(list, tuple), torch_rng=torch.Tensor
    )
    for key, kind in expected.items():
        if not isinstance(state, dict) or not isinstance(state.get(key), kind):
            raise CheckpointError(
                f"{file}: damaged or not a flashrl trainer state (no valid {key!r} entry)"
            )
    return state


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check that checkpoint `path` is complete (config.json parses, every safetensors file is
    whole, every file matches its size and SHA-256 in `manifest.json`, the trainer state loads) and
    return its trainer state; CheckpointError naming the damaged file."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a directory")
    config = path / "config.json"
    try:
        model_config = json.loads(config.read_bytes())
        if not isinstance(model_config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{config}: missing or damaged ({err})") from None
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"{path}: no *.safetensors weights; not a flashrl checkpoint")
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in weights:
        try:
            with safe_open(file, "pt") as f:  # reads the header, checks it covers the whole file
                shapes.update((k, f.get_slice(k).get_shape()) for k in f.keys())
        except Exception as err:
            raise CheckpointError(f"{file}: damaged safetensors file ({err})") from None
    check_manifest(path)
    _check_config_fits_weights(config, model_config, shapes)
    state = load_state(path)
    named = _CHECKPOINT.fullmatch(path.name)
    if named and int(named.group(1)) != state["step"]:
        raise CheckpointError(
            f"{path}: named for step {named.group(1)} but holds step {state['step']} (renamed?); "
            f"checkpoints are ordered by the step in their name: rename it to "
            f"checkpoint-{state['step']}"
        )
    return state


def _check_config_fits_weights(
    config: Path, model_config: dict[str, Any], shapes: dict[str, list[int]]
) -> None:
    """config.json describes the weights beside it (embedding [vocab, hidden], layer count): a
    config.json copied from another model is refused naming both, before anything loads."""
    embed = shapes.get("model.embed_tokens.weight")
    layers = {int(m.group(1)) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    said = [model_config.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")]
    found = [*(embed or [None, None]), (max(layers) + 1) if layers else None]
    wrong = [
        f"{key} {a} (weights: {b})"
        for key, a, b in zip(("vocab_size", "hidden_size", "num_hidden_layers"), said, found)
        if b is not None and a != b
    ]
    if wrong:
        raise CheckpointError(
            f"{config}: does not describe the weights beside it ({'; '.join(wrong)}): a "
            f"config.json of another model ({model_config.get('model_type', '?')}); restore the "
            "checkpoint's own config.json"
        )


def find_latest(output_dir: Path) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """The newest complete checkpoint in `output_dir`, its state, and the damaged newer ones with
    why."""
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(output_dir)):
        try:
            return path, verify_checkpoint(path), damaged
        except CheckpointError as err:
            damaged.append((path, str(err)))
    if not damaged:
        raise CheckpointError(
            f"--run.resume latest: no checkpoint-<step> directory in {str(output_dir)!r}"
        )
    raise CheckpointError(
        f"--run.resume latest: no complete checkpoint in {str(output_dir)!r}: "
        + "; ".join(why for _, why in damaged)
    )


def set_damaged_aside(damaged: list[tuple[Path, str]], resumed: Path) -> None:
    """Rename damaged checkpoints to `checkpoint-<step>.damaged` so `--run.resume latest` skips
    them."""
    for path, why in damaged:
        target = path.with_name(path.name + ".damaged")
        logger.warning(
            "%s is damaged (%s); resuming from %s and renaming it to %s",
            path,
            why,
            resumed,
            target.name,
        )
        shutil.rmtree(target, ignore_errors=True)
        path.rename(target)


PATH_FIELDS = ("model", "data.path")
"""Config fields naming a path: two spellings of the same file are no difference."""


def config_differences(
    stored: dict[str, Any], current: dict[str, Any], free: set[str]
) -> list[str]:
    """'field: A in the checkpoint, B now' for every field outside `free` whose value differs
    (both configs as dotted values, `flashrl.rl.config_build.stored_values`)."""
    out = []
    for name, value in current.items():
        if name in free or name not in stored or stored[name] == value:
            continue
        old = stored[name]
        if (
            name in PATH_FIELDS
            and isinstance(old, str)
            and isinstance(value, str)
            and Path(old).resolve() == Path(value).resolve()
        ):
            continue
        out.append(f"{name}: {old!r} in the checkpoint, {value!r} now")
    return out


# ------------------------------------------------------------------ metrics.jsonl


def _metrics_lines(path: Path) -> list[tuple[dict[str, Any], str]]:
    """(row, line) of every line of a metrics.jsonl; see `read_metrics`."""
    lines = path.read_bytes().split(b"\n")
    numbered = [(i, raw) for i, raw in enumerate(lines, 1) if raw.strip()]
    out = []
    for k, (i, raw) in enumerate(numbered):
        try:
            text = raw.decode("utf-8")
            row = json.loads(text)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a JSON object with an integer 'step'")
        except ValueError as err:  # also UnicodeDecodeError and JSONDecodeError
            if k == len(numbered) - 1:
                logger.warning(
                    "%s line %d is torn (a write interrupted by a crash or a full "
                    "disk): dropped it",
                    path,
                    i,
                )
                break
            raise CheckpointError(
                f"{path} line {i} is damaged ({err}); only the last line may be torn: "
                f"repair or delete line {i}"
            ) from None
        out.append((row, text))
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, in today's key names (old ones renamed by
    `flashrl.rl.metric_names.upgrade_row`). A torn last line (a write cut by a crash) is dropped
    with a warning; a bad line elsewhere is a CheckpointError naming the file and line."""
    return [upgrade_row(row) for row, _ in _metrics_lines(Path(path))]


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps before `step` (the resumed run recomputes the rest), dropping a torn
    last line; the file is replaced (temp file + fsync + rename), never rewritten in place."""
    if not path.is_file():
        return
    kept = [text for row, text in _metrics_lines(path) if row["step"] < step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))
