"""`tiny`'s seeded weights kept on disk from one process to the next.

Making them costs a process about 2.5 s (hundreds of small eager initializer ops, each traced
and compiled for its shape), which every server start and command run with `tiny` would pay
again for the same numbers. A file holds one dtype's weights and is named by the key of
everything they depend on: the dtype, the seed, jax's and flax's versions and the source of
every module under `flipjax/model` (the initializers and the tree's shape), so any change to
them makes another file. A file is read only when it is this user's own, in a folder nobody
else can write, and holds exactly the leaves, shapes and dtype widths the module's own
abstract state has (the dtypes themselves are in the key); otherwise the weights are made
anew. Writers write a temporary file, fsync it and rename it into place, so a reader never
sees half of one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import flax
import jax
import numpy as np

from kernels_pallas.private_files import kept_file_problem, write_private

log = logging.getLogger(__name__)
CACHE_ENV = "FLIPJAX_TINY_CACHE"  # a folder, or "off"
_SOURCES = Path(__file__).parent


def cached_leaves(
    dtype: str,
    seed: int,
    abstract: list[jax.ShapeDtypeStruct],
    make: Callable[[], list[np.ndarray]],
) -> list[np.ndarray]:
    """The leaves `make()` returns, from this dtype's file when one matches `abstract` (their
    shapes and dtype widths, in order), else made and written for the next process."""
    path = _path(dtype, seed)
    if path is not None:
        leaves = _read(path, abstract)
        if leaves is not None:
            return leaves
    leaves = make()
    if path is not None:
        _write(path, leaves)
    return leaves


def _path(dtype: str, seed: int) -> Path | None:
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "off":
        return None
    if chosen:
        folder = Path(chosen)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        folder = Path(base) / "flipjax" / "tiny"
    key = hashlib.sha256(f"{dtype} {seed} {jax.__version__} {flax.__version__}".encode())
    for source in sorted(_SOURCES.glob("*.py")):
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    return folder / f"tiny-{dtype}-{key.hexdigest()[:16]}.npz"


def _read(path: Path, abstract: list[jax.ShapeDtypeStruct]) -> list[np.ndarray] | None:
    """The file's leaves as `abstract` says they are; None when there is no file, or it cannot
    be trusted or does not match (said in the log, and the weights are made anew)."""
    if not path.exists():
        return None
    problem = kept_file_problem(path)
    if problem is not None:
        log.warning("tiny weights: %s %s; making them anew", path, problem)
        return None
    try:
        with np.load(path, allow_pickle=False) as held:
            raw = [held[f"w{i}"] for i in range(len(abstract))]
            extra = len(held.files) != len(abstract)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        log.warning("tiny weights: %s unreadable (%s); making them anew", path, err)
        return None
    leaves = []
    for x, want in zip(raw, abstract, strict=True):
        if extra or x.dtype.itemsize != np.dtype(want.dtype).itemsize or x.shape != want.shape:
            log.warning("tiny weights: %s does not match the model; making them anew", path)
            return None
        leaves.append(x.view(want.dtype))
    return leaves


def _write(path: Path, leaves: list[np.ndarray]) -> None:
    """Best effort: a folder that cannot be written leaves the next process to make them."""
    # As unsigned ints of the same width: npz has no bfloat16.
    bits = {f"w{i}": x.view(f"u{x.dtype.itemsize}") for i, x in enumerate(leaves)}
    held = io.BytesIO()
    np.savez(held, **bits)
    try:
        write_private(path, held.getvalue())
    except OSError as err:
        log.info("tiny weights: not kept (%s)", err)
