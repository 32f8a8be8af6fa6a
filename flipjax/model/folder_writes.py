"""A checkpoint folder written whole or not at all: filled under a `.partial` sibling, its files
synced, and renamed into place last, so a folder that exists is complete."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator


@contextlib.contextmanager
def whole_folder(folder: str) -> Iterator[str]:
    """Yields the partial folder to fill; `folder` must not exist (nothing is overwritten). On
    an error the partial folder is removed and `folder` never appears."""
    if os.path.exists(folder):
        raise FileExistsError(f"output: {folder} already exists; refusing to overwrite it")
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        yield partial
        for root, _, names in os.walk(partial):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, folder)
