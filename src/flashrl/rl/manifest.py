"""`manifest.json` of a checkpoint: the size and SHA-256 of every file in it, written last.

A checkpoint that parses can still be damaged: flipped bytes inside `model.safetensors` leave its
header valid and load as different weights. The manifest makes such damage visible on resume:
`check_manifest` recomputes each file's digest and raises a `CheckpointError` naming the file, so
`--run.resume latest` falls back to the previous complete checkpoint, as for any other damage.

A checkpoint without a manifest (written by flashrl before it had one) is checked structurally
only, and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from flashrl.errors import CheckpointError
from flashrl.fileio import atomic_write_text

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 22


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> Path:
    """Record every file under `directory` (relative path, bytes, SHA-256) in its manifest."""
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    text = json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1, sort_keys=True)
    return atomic_write_text(directory / MANIFEST_FILE, text + "\n")


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST_FILE
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: unreadable or damaged ({err})") from None
    entries = data.get("files") if isinstance(data, dict) else None
    valid = isinstance(entries, dict) and all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
        for e in entries.values()
    )
    if not valid or data.get("version") != MANIFEST_VERSION:
        raise CheckpointError(
            f"{file}: damaged or of an unknown version (expected version {MANIFEST_VERSION} with a "
            f"'files' map of bytes and sha256)"
        )
    return entries


def check_manifest(path: Path) -> bool:
    """Verify every file that checkpoint `path`'s manifest lists: present, of the recorded size and
    SHA-256. Returns False when there is no manifest (an older checkpoint); raises a
    `CheckpointError` naming the first file that differs."""
    if not (path / MANIFEST_FILE).exists():
        logger.info(
            "%s has no %s (an older checkpoint): checked structurally only", path, MANIFEST_FILE
        )
        return False
    for name, entry in sorted(_read_manifest(path).items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {MANIFEST_FILE} but missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{file}: {size} bytes, {MANIFEST_FILE} recorded {entry['bytes']}; damaged"
            )
        if file_digest(file) != entry["sha256"]:
            raise CheckpointError(
                f"{file}: SHA-256 differs from the one in {MANIFEST_FILE}; the file was changed "
                "or damaged after the checkpoint was written"
            )
    return True
