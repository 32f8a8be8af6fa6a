"""Durability barriers: fsync one path, or flush a whole file system at once for several."""

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
