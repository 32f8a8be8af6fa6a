"""Files this user's caches keep (kernel libraries, their calibration, weights, traced steps):
whether one can be trusted, and how one is written so that no reader sees half of it.

A cache folder that someone else can write could hand this process a library to load or a
program to run, so a file is trusted only when it and its folder are this user's own, are no
links, and nobody else can write them.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def private_problem(path: Path, what: str) -> str | None:
    """Why `path` (a "folder", or a plain file of the kind `what` names) cannot be trusted: not
    this user's own, a link, or writable by others; None when it can."""
    st = os.lstat(path)
    kind = stat.S_ISDIR if what == "folder" else stat.S_ISREG
    if not kind(st.st_mode):
        return f"is not a plain {what}"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"can be written by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def kept_file_problem(path: Path) -> str | None:
    """Why a cache's file `path` cannot be trusted, its folder first; None when both can."""
    return private_problem(path.parent, "folder") or private_problem(path, "file")


def write_private(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` through a temporary file beside it, fsynced and renamed into
    place (readable by this user only, its folder made private if missing). OSError when it
    cannot be written; no partial file is left either way."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
