"""Durability barriers: fsync one path, replace a file atomically, or flush a whole file system
at once for several."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes, suffix: str = ".tmp") -> None:
    """Make `data` the file at `path`, atomically and durably: written to `path + suffix`,
    fsynced, renamed over `path`, and the folder fsynced (a crash leaves the old file or the
    new one, whole)."""
    tmp = path + suffix
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


def _syncfs() -> Callable[[int], int] | None:
    """Linux `syncfs(2)`: one call makes every dirty file of a file system durable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs
    except (OSError, AttributeError):
        return None


_SYNCFS = _syncfs()


def barrier(root: str, paths: list[str]) -> None:
    """Make `paths` (files under `root`) durable: fsync each, or, for several on a system
    with `syncfs`, one flush of the whole file system."""
    if len(paths) > 1 and _SYNCFS is not None:
        fd = os.open(root, os.O_RDONLY)
        try:
            if _SYNCFS(fd) != 0:
                raise OSError(ctypes.get_errno(), "syncfs failed", root)
        finally:
            os.close(fd)
        return
    for path in paths:
        fsync_path(path)
