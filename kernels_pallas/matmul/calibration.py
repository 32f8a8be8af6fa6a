"""Which row counts the native matmul takes on this machine: chosen by timing it against XLA's
dot once per kernel build, for a mid-size projection and for a weight as wide as a vocabulary,
and cached with the build.

Where the kernel beats XLA's dot depends on the CPU, so no constant holds everywhere. On one
AVX-512 machine the fp32 kernel won from 2 to 32 rows; built for AVX2 on the same machine it
lost from 32 rows on, to half XLA's rate (`python -m flipjax.bench matmul`). The first use of
`native_rows` for a build therefore times both products as the engine runs them, over weights
spanning twice the last-level cache this CPU reports (a decode step reads each weight once, from
memory; see `kernels_pallas.cpu_caches`), and keeps, per weight
dtype, the run of candidate row counts over which the kernel saved the most. Weights of
`WIDE_COLUMNS` columns or more (an lm head) have a choice of their own: the same AVX2 build lost
to XLA's dot from 16 rows on a [768, 32000] weight while it won at 16-48 rows on [1024, 2048]
(two calibrations each, one machine), so one choice for both gave the lm head to the slower
path or the projections to it. The choice is
written beside the kernel's library, under the same key (source, flags, jaxlib, CPU), so it is
made once: every later step and process dispatches the same way, and a row count never flips
between paths from one run to the next, so neither do tokens.

`FLIPJAX_NATIVE_MATMUL_ROWS` sets the choice instead, for weights of every width:
`float32=2-32,bfloat16=1-8` (a dtype left out runs XLA's dot), or `none`. This module imports
nothing from flipjax.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_caches, native
from kernels_pallas.matmul import native_binding
from kernels_pallas.matmul.xla_form import xla_matmul
from kernels_pallas.private_files import private_problem, write_private

ROWS_ENV = "FLIPJAX_NATIVE_MATMUL_ROWS"
DTYPES = ("float32", "bfloat16")
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
WEIGHT_SHAPE = (1024, 2048)  # [in, out]: a mid-size projection
WIDE_SHAPE = (1024, 32000)  # a vocabulary's width (not a power of two, as vocabularies are not)
WIDE_COLUMNS = 8192  # a weight this wide dispatches by the choice WIDE_SHAPE measured
WIDE = ":wide"  # the suffix of a dtype's name that keys its wide weights' choice
ROUNDS = 5
TIE = 0.03  # the kernel at most this much slower than XLA's dot: a tie, as noise goes
MAX_ROWS = 1 << 16
CACHE_SUFFIX = ".rows.json"

# Per dtype name (with WIDE for wide weights), per row count: (native seconds, XLA seconds) per
# product.
Times = dict[str, dict[int, tuple[float, float]]]
KEYS = (*DTYPES, *(name + WIDE for name in DTYPES))

log = logging.getLogger(__name__)
_lock = threading.Lock()


def native_rows(dtype: jnp.dtype, isa: str | None = None, columns: int = 0) -> range:
    """The row counts whose products with a `dtype` weight of `columns` columns the native
    kernel runs, for the build `isa` (default: `native.build_isa()`):
    `FLIPJAX_NATIVE_MATMUL_ROWS` if set, else this machine's calibration (measured on first
    use, then read from the cache) for weights of that width."""
    name = jnp.dtype(dtype).name
    spec = os.environ.get(ROWS_ENV)
    if spec:
        return parse(spec).get(name, range(0))
    choice = calibrated(isa or native.build_isa())
    return choice.get(name + WIDE if columns >= WIDE_COLUMNS else name, range(0))


@functools.cache
def parse(spec: str) -> dict[str, range]:
    """`float32=2-32,bfloat16=1-8` (or `none`) as ranges; ValueError naming the variable."""
    if spec.strip() == "none":
        return {}
    choice = {}
    for part in spec.split(","):
        name, _, bounds = part.strip().partition("=")
        lo, _, hi = bounds.partition("-")
        if name not in DTYPES or name in choice or not (lo.isdigit() and hi.isdigit()):
            raise ValueError(
                f"{ROWS_ENV}: cannot read {part!r}; expected e.g. 'float32=2-32,bfloat16=1-8' "
                f"(dtypes {DTYPES}, each once) or 'none'"
            )
        if not 1 <= int(lo) <= int(hi) <= MAX_ROWS:
            raise ValueError(f"{ROWS_ENV}: {part!r} needs 1 <= low <= high <= {MAX_ROWS}")
        choice[name] = range(int(lo), int(hi) + 1)
    return choice


def calibrated(isa: str) -> dict[str, range]:
    """The cached choice for the build `isa`, measured and cached first if there is none."""
    with _lock:
        return _calibrated(isa)


@functools.cache
def _calibrated(isa: str) -> dict[str, range]:
    path = native.cached_beside("matmul", isa, CACHE_SUFFIX)
    choice = load(path)
    if choice is None:
        # In a thread of its own: the first use is usually while a step is being traced, and
        # the products timed here must run, not be staged into that trace.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            times = pool.submit(measure, isa).result()
        choice = choose(times)
        store(path, choice, times)
        log.info(
            "native matmul calibrated for the %s build: %s (cached in %s)",
            isa,
            describe(choice),
            path,
        )
    return choice


def describe(choice: dict[str, range]) -> str:
    """`float32 rows 2-32, bfloat16 rows 1-8` (`XLA` for a dtype the kernel never takes), then
    the wide weights' choice where the choice has one (`float32:wide rows 2-8`)."""
    parts = []
    for name in KEYS:
        if name not in choice and name.endswith(WIDE):
            continue
        rows = choice.get(name, range(0))
        parts.append(f"{name} rows {rows.start}-{rows.stop - 1}" if rows else f"{name} XLA")
    return ", ".join(parts)


def choose(times: Times) -> dict[str, range]:
    """Per dtype, the run of consecutive candidates over which the kernel saves the most (the
    sum of 1 - native/XLA time: a batch of each size counts alike), from its first row count to
    its last; none where it saves nothing. A run may bridge one candidate the kernel lost by
    less than its neighbours won, as noise on a busy machine does, and takes in the candidates
    at either end where the two tie (within `TIE`): one row is a matvec on either path, bound by
    reading the weight, so which wins there is noise (one calibration gave it to XLA by 1.3%,
    and its one-row decode steps then took 9% longer than the kernel's), and the kernel gives a
    row the same result whatever the rows beside it."""
    choice = {}
    for name, by_rows in times.items():
        rows = sorted(by_rows)
        ratio = [by_rows[m][0] / by_rows[m][1] for m in rows]
        best, first, last = 0.0, 0, -1
        total, start = 0.0, 0
        for i in range(len(rows)):
            if total <= 0:
                total, start = 0.0, i
            total += 1 - ratio[i]
            if total > best:
                best, first, last = total, start, i
        if last >= 0:
            while first > 0 and ratio[first - 1] <= 1 + TIE:
                first -= 1
            while last + 1 < len(rows) and ratio[last + 1] <= 1 + TIE:
                last += 1
        choice[name] = range(rows[first], rows[last] + 1) if last >= 0 else range(0)
    return choice


def measure(
    isa: str,
    rows: tuple[int, ...] = CANDIDATE_ROWS,
    shape: tuple[int, int] = WEIGHT_SHAPE,
    sweep_bytes: int | None = None,
    rounds: int = ROUNDS,
    wide_shape: tuple[int, int] = WIDE_SHAPE,
) -> Times:
    """Per dtype and row count, XLA's fastest of `rounds` passes over enough copies of a
    `shape` weight to fill `sweep_bytes` (default: twice the last-level cache), per product, and
    the kernel's: that times the median of the rounds' ratios, each round timing the two back to
    back (a shared machine's speed drifts by a third within a minute; each path's own fastest
    pass, taken apart, chose differently from one calibration to the next). The same for a
    `wide_shape` weight, under the dtype's name with WIDE."""
    device = jax.local_devices(backend="cpu")[0]
    targets = native_binding.targets(isa)
    ours = jax.jit(lambda x, w: native_binding.matmul(targets, x, w))
    theirs = jax.jit(xla_matmul)
    rng = np.random.default_rng(0)
    times: Times = {}
    shapes = {**{d: shape for d in DTYPES}, **{d + WIDE: wide_shape for d in DTYPES}}
    for name, (k, n) in shapes.items():
        dtype = jnp.dtype(name.removesuffix(WIDE))
        first = jax.device_put((rng.standard_normal((k, n)) * 0.02).astype(dtype), device)
        weights = cpu_caches.uncached_copies(first, sweep_bytes)
        copies = len(weights)
        times[name] = {}
        for m in rows:
            x = jax.device_put(rng.standard_normal((m, k)).astype(np.float32), device)
            x_model = x.astype(dtype)  # Linear's input on XLA's path is in the model's dtype
            _check_agree(np.asarray(ours(x, weights[0])), np.asarray(theirs(x_model, weights[0])))
            native_pass = _timed_pass(lambda w, x=x: ours(x, w), weights)
            xla_pass = _timed_pass(lambda w, x=x_model: theirs(x, w), weights)
            ratios, fastest = [], float("inf")
            for _ in range(rounds):
                native_s, xla_s = native_pass(), xla_pass()
                ratios.append(native_s / xla_s)
                fastest = min(fastest, xla_s)
            times[name][m] = (statistics.median(ratios) * fastest / copies, fastest / copies)
    return times


def _check_agree(native_y: np.ndarray, xla_y: np.ndarray) -> None:
    """RuntimeError unless the two products agree (to bf16 rounding of XLA's input): a kernel
    that computes something else must not win on speed."""
    if not np.allclose(native_y, xla_y.astype(np.float32), rtol=2e-2, atol=2e-2):
        worst = float(np.max(np.abs(native_y - xla_y.astype(np.float32))))
        raise RuntimeError(f"native matmul calibration: the kernel and XLA's dot differ by {worst}")


def _timed_pass(product: Callable[[jax.Array], jax.Array], weights: list[jax.Array]):
    """A function timing one pass of `product` over every weight (compiled and warmed here)."""
    jax.block_until_ready([product(w) for w in weights])

    def timed() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready([product(w) for w in weights])
        return time.perf_counter() - t0

    return timed


def load(path: Path) -> dict[str, range] | None:
    """The choice cached at `path`; None (and why, logged) if there is none that can be
    trusted: absent, not this user's own or writable by others, or not a valid choice."""
    if not os.path.lexists(path):
        return None
    problem = private_problem(path, "file")
    if problem is None:
        try:
            cached = json.loads(path.read_text())["rows"]
            return {name: _checked_range(cached[name]) for name in KEYS}
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


def store(path: Path, choice: dict[str, range], times: Times) -> None:
    """Write the choice (and the times behind it) to `path` atomically, readable by this user
    only: a reader never sees half a file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    rows = {n: [r.start, r.stop - 1] if (r := choice.get(n, range(0))) else None for n in KEYS}
    seconds = {n: {str(m): list(t) for m, t in by_rows.items()} for n, by_rows in times.items()}
    write_private(path, json.dumps({"rows": rows, "seconds": seconds}).encode())
