"""The native matmul's calibration as cached beside its build (`calibration.py` measures and
chooses): a small JSON file, written atomically and readable by its owner only, and read back
only if it is this user's own, nobody else can write it, and every value is one a calibration
could have chosen; and the choice in words. This module imports nothing from flipjax."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kernels_pallas.private_files import private_problem, write_private

DTYPES = ("float32", "bfloat16")
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
WIDE = ":wide"  # the suffix of a dtype's name that keys its wide weights' choice
KEYS = (*DTYPES, *(name + WIDE for name in DTYPES))
INT8 = "int8"  # quantized weights: timed for the choice of build only (see `native_build`)
NARROWER_KEYS = (*KEYS, INT8)
MAX_ROWS = 1 << 16
NARROWER = "x86-64-v3"  # the build an AVX-512 build's calibration times beside its own
CACHE_SUFFIX = ".choice.json"

# Per dtype name (with WIDE for wide weights), per row count: (native seconds, XLA seconds) per
# call (of a pair of projections, or of one weight), then the narrower build's where timed too.
Times = dict[str, dict[int, tuple[float, ...]]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """A build's calibration: per key, the row counts the kernel takes (`rows`), and the
    candidate row counts at which its narrower build's kernel runs them (`narrower`)."""

    rows: dict[str, range]
    narrower: dict[str, tuple[int, ...]] = field(default_factory=dict)


def load(path: Path) -> Choice | None:
    """The choice cached at `path`; None (and why, logged) if there is none that can be
    trusted: absent, not this user's own or writable by others, or not a valid choice."""
    if not os.path.lexists(path):
        return None
    problem = private_problem(path, "file")
    if problem is None:
        try:
            cached = json.loads(path.read_text())
            rows = {name: _checked_range(cached["rows"][name]) for name in KEYS}
            narrower = {name: _checked_rows(cached["narrower"][name]) for name in NARROWER_KEYS}
            return Choice(rows, narrower)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"is not a valid choice ({type(e).__name__}: {e})"
    log.warning("native matmul calibration %s %s; measuring again", path, problem)
    return None


def _checked_range(bounds: object) -> range:
    if bounds is None:
        return range(0)
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(type(b) is int for b in bounds)):
        raise ValueError(f"rows must be [low, high] or null, got {bounds!r}")
    lo, hi = bounds
    if not 1 <= lo <= hi <= MAX_ROWS:
        raise ValueError(f"rows [{lo}, {hi}] outside 1 <= low <= high <= {MAX_ROWS}")
    return range(lo, hi + 1)


def _checked_rows(rows: object) -> tuple[int, ...]:
    if not (isinstance(rows, list) and all(type(m) is int and m in CANDIDATE_ROWS for m in rows)):
        raise ValueError(f"narrower rows must be a list of {CANDIDATE_ROWS}, got {rows!r}")
    return tuple(rows)


def store(path: Path, choice: Choice, times: Times) -> None:
    """Write the choice (and the times behind it) to `path` atomically, readable by this user
    only: a reader never sees half a file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    rows = choice.rows
    ranges = {n: [r.start, r.stop - 1] if (r := rows.get(n, range(0))) else None for n in KEYS}
    narrower = {n: list(choice.narrower.get(n, ())) for n in NARROWER_KEYS}
    seconds = {n: {str(m): list(t) for m, t in by_rows.items()} for n, by_rows in times.items()}
    body = {"rows": ranges, "narrower": narrower, "seconds": seconds}
    write_private(path, json.dumps(body).encode())


def describe(choice: dict[str, range], narrower: dict[str, tuple[int, ...]] | None = None) -> str:
    """`float32 rows 2-32, bfloat16 rows 1-8` (`XLA` for a dtype the kernel never takes), then
    the wide weights' choice where the choice has one (`float32:wide rows 2-8`), each with the
    row counts NARROWER's kernel runs (`float32 rows 1-64 (8 by x86-64-v3)`)."""
    parts = []
    for name in KEYS:
        if name not in choice and name.endswith(WIDE):
            continue
        rows = choice.get(name, range(0))
        part = f"{name} rows {rows.start}-{rows.stop - 1}" if rows else f"{name} XLA"
        if rows and (by := [m for m in (narrower or {}).get(name, ()) if m in rows]):
            part += f" ({', '.join(map(str, by))} by {NARROWER})"
        parts.append(part)
    return ", ".join(parts)
