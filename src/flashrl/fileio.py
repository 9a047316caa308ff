"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never a half-written one;
`check_input_file`: an input path that is a readable file, or one line saying what it is instead."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from flashrl.errors import InputError

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once at import: os.umask can only be read by setting it


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` via a temporary file in the same directory: write, fsync, rename over
    `path`, fsync the directory. A symlink is followed (its target is replaced, the link kept). On any
    error the previous `path` is untouched and the temporary file is removed; the error propagates."""
    path = Path(os.path.realpath(path))
    try:
        mode = path.stat().st_mode & 0o777  # keep an existing file's permissions
    except OSError:
        mode = 0o666 & ~_UMASK  # what open() would give a new file (mkstemp's is 0o600)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """`atomic_write_bytes` of `text` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory` (before it is renamed into place)."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def fsync_dir(directory: Path) -> None:
    """Make renames and new entries in `directory` durable (a no-op where directories cannot be
    opened, e.g. on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device, not a file",
    stat.S_IFBLK: "a block device, not a file",
    stat.S_IFIFO: "a named pipe, not a file",
    stat.S_IFSOCK: "a socket, not a file",
}


def check_input_file(
    path: str | Path,
    what: str,
    expected: str,
    error: type[Exception] = InputError,
    missing: type[Exception] = FileNotFoundError,
) -> Path:
    """`path` as a regular file that can be opened for reading; else one line saying what it is
    instead: `missing` for a file (or a link's target) that does not exist, `error` for a directory,
    a device such as /dev/null, a pipe, or a file that cannot be read (with the system's reason,
    e.g. Permission denied). `what` names the file (``"dataset file"``), `expected` what is
    allowed (``"a .jsonl file"``)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            target = os.readlink(path)
            message = f"{what} {str(path)!r} is a link to {target!r}, which does not exist"
            raise missing(message) from None
        raise missing(f"{what} {str(path)!r} does not exist") from None
    except OSError as err:  # e.g. a directory on the way that cannot be searched
        raise error(
            f"{what} {str(path)!r} cannot be read ({err.strerror}); expected {expected}"
        ) from None
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise error(f"{what} {str(path)!r} is {kind}; expected {expected}")
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as err:
        raise error(
            f"{what} {str(path)!r} cannot be read ({err.strerror}); expected {expected}"
        ) from None
    return path
