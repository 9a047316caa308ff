"""Durable writes of a run's files, and what a full disk says: the path, what was needed, what is
free, and what was kept intact."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from flashrl.errors import CheckpointError

__all__ = ["append_line", "disk_full_message", "tree_bytes"]


def append_line(path: str | Path, line: str) -> None:
    """Append `line` and a newline to `path` in one write, then fsync: a crash tears at most this
    line."""
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        view = memoryview(data)
        while view:  # one call unless the kernel accepts only part of it (a full disk)
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CheckpointError(
            f"appending to {path}: no space left on the device ({len(data)} bytes needed, "
            f"{shutil.disk_usage(Path(path).parent).free} free); the lines before are intact "
            "(resume drops a torn last line); free space, then --run.resume latest"
        ) from None
    finally:
        os.close(fd)


def tree_bytes(directory: Path) -> int:
    """Bytes of every file under `directory`."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def disk_full_message(path: Path, written: int, previous: Path | None) -> str:
    """A full disk while saving checkpoint `path`: where, how much a checkpoint needs (the
    `previous` one's size, else at least what was written), what is free, and that the previous
    checkpoint is untouched."""
    needed = max(tree_bytes(previous) if previous is not None else 0, written)
    free = shutil.disk_usage(path.parent).free
    kept = f"; {previous.name} is intact" if previous is not None else ""
    return (
        f"saving {path}: no space left on the device after {written / 2**20:.1f} MiB; a checkpoint "
        f"needs about {needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free; the partial "
        f"write was removed{kept}; free space or set --run.output-dir elsewhere"
    )
