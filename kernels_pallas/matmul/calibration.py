"""Which row counts the native matmul takes on this machine: chosen by timing it against XLA's
dot once per kernel build, for a layer's two mid-size projections from one input and for a
weight as wide as a vocabulary, and cached with the build.

Where the kernel beats XLA's dot depends on the CPU, so no constant holds everywhere. On one
AVX-512 machine the fp32 kernel won from 2 to 32 rows; built for AVX2 on the same machine it lost
from 32 rows on, to half XLA's rate (`python -m flipjax.bench matmul`). The first use of
`native_rows` for a build therefore times both paths as the engine runs them (a layer's
projections from one input in one call of the kernel, `matmuls`, or in a dot each: timed one
weight at a time, an AVX2 build's kernel lost to XLA's dot by 14% at 32 rows, as a pair it
tied, and batch-32 decode steps ran 2-4% faster on it than on XLA's dot), over weights
spanning twice the last-level cache this CPU reports (a decode step reads each weight once, from
memory; see `kernels_pallas.cpu_caches`), and keeps, per weight dtype, the run of candidate row
counts over which the kernel saved the most. Weights of `WIDE_COLUMNS` columns or more (an lm head)
have a choice of their own: the same AVX2 build lost to XLA's dot from 16 rows on a [768, 32000]
weight while it won at 16-48 rows on [1024, 2048] (two calibrations each, one machine), so one
choice for both gave the lm head to the slower path or the projections to it. The choice is written
beside the kernel's library, under the same key (source, flags, jaxlib, CPU), so it is made once:
every later step and process dispatches the same way, and a row count never flips between paths
from one run to the next, so neither do tokens.

A build of AVX-512 kernels also times the AVX2 build's (`x86-64-v3`): its products are the same
bits (each output sums over k in order, whatever the vector width; `measure` checks it), and on a
2-core AMD Zen 4 it ran the 8-row products of a decode step's [768, 2048] and [2048, 768] weights
7-30% faster than the AVX-512 build, and took 1.24-1.58 times as long from 16 rows. Where the
narrower build is faster by more than a tie, it takes that row count (`native_build`).

`FLIPJAX_NATIVE_MATMUL_ROWS` sets the choice instead, for weights of every width (run by the
build's own kernel): `float32=2-32,bfloat16=1-8` (a dtype left out runs XLA's dot), or `none`. This
module imports nothing from flipjax.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_caches, native
from kernels_pallas.matmul import native_binding
from kernels_pallas.matmul.calibration_choice import (
    ROWS_ENV,
    choose,
    choose_narrower,
    disputed,
    parse,
)
from kernels_pallas.matmul.calibration_file import (
    CACHE_SUFFIX,
    CANDIDATE_ROWS,
    DTYPES,
    INT8,
    KEYS,
    NARROWER,
    WIDE,
    Choice,
    Times,
    describe,
    load,
    store,
)
from kernels_pallas.matmul.xla_form import xla_int8_matmul, xla_matmul

Weight = jax.Array | tuple[jax.Array, ...]  # one weight, or a layer's projections from one input
WEIGHT_SHAPE = (1024, 2048)  # [in, out]: a mid-size projection
WIDE_SHAPE = (1024, 32000)  # a vocabulary's width (not a power of two, as vocabularies are not)
WIDE_COLUMNS = 8192  # a weight this wide dispatches by the choice WIDE_SHAPE measured
ROUNDS = 5
AGAIN = 2  # a disputed row count's further rounds, per round of the first pass

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
    return choice.rows.get(_key(name, columns), range(0))


def native_build(dtype: jnp.dtype, rows: int, isa: str | None = None, columns: int = 0) -> str:
    """The build whose kernel multiplies `rows` rows (a decode step's) by a `dtype` weight of
    `columns` columns, among those the build `isa` (default: `native.build_isa()`) may use:
    NARROWER where its calibration found it faster at the largest candidate row count at or
    below `rows`, else `isa` itself (always, where `FLIPJAX_NATIVE_MATMUL_ROWS` is set)."""
    isa = isa or native.build_isa()
    if os.environ.get(ROWS_ENV):
        return isa
    narrower = calibrated(isa).narrower.get(_key(jnp.dtype(dtype).name, columns), ())
    candidate = max((m for m in CANDIDATE_ROWS if m <= rows), default=0)
    return NARROWER if candidate in narrower else isa


def in_force(isa: str | None = None) -> tuple[object, ...]:
    """All that `native_rows` and `native_build` answer from: the key of programs traced now."""
    isa = isa or native.build_isa()
    if spec := os.environ.get(ROWS_ENV):
        return (isa, spec)
    choice = calibrated(isa)
    rows = sorted((name, r.start, r.stop) for name, r in choice.rows.items())
    return (isa, rows, sorted(choice.narrower.items()))


def narrower_build(isa: str) -> str | None:
    """NARROWER, where `isa` builds AVX-512 kernels and this CPU runs NARROWER's; else None."""
    wide = isa == "x86-64-v4" or (isa == "native" and "avx512f" in native.cpu_flags())
    return NARROWER if wide and native.runs_here(NARROWER) else None


def _key(name: str, columns: int) -> str:
    return name + WIDE if columns >= WIDE_COLUMNS and name != INT8 else name


def calibrated(isa: str) -> Choice:
    """The cached choice for the build `isa`, measured and cached first if there is none."""
    with _lock:
        return _calibrated(isa)


@functools.cache
def _calibrated(isa: str) -> Choice:
    path = native.cached_beside("matmul", isa, CACHE_SUFFIX)
    choice = load(path)
    if choice is None:
        # In a thread of its own: the first use is usually while a step is being traced, and
        # the products timed here must run, not be staged into that trace.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            times = pool.submit(measure, isa).result()
        choice = Choice(
            choose({k: t for k, t in times.items() if k in KEYS}), choose_narrower(times)
        )
        store(path, choice, times)
        log.info(
            "native matmul calibrated for the %s build: %s (cached in %s)",
            isa,
            describe(choice.rows, choice.narrower),
            path,
        )
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
    `shape` weight to fill `sweep_bytes` (default: twice the last-level cache), each copy split
    into the two halves of its columns (a layer's pair of projections), per call, and
    the kernel's: that times the median of the rounds' ratios, each round timing the paths back
    to back (a shared machine's speed drifts by a third within a minute; each path's own fastest
    pass, taken apart, chose differently from one calibration to the next). The same for a
    `wide_shape` weight, under the dtype's name with WIDE. Where `isa` has a narrower build
    (`narrower_build`), its kernel is timed in the same rounds, if its products are the build's
    own bit for bit (else it is left out, and the log says why). A row count whose verdict its
    neighbours' both contradict (`disputed`) is timed for AGAIN times as many rounds more, its
    ratios pooled with the first ones."""
    device = jax.local_devices(backend="cpu")[0]
    narrower = narrower_build(isa)
    builds = [isa] if narrower is None else [isa, narrower]
    rng = np.random.default_rng(0)
    times: Times = {}
    shapes = {**{d: shape for d in DTYPES}, **{d + WIDE: wide_shape for d in DTYPES}}
    if narrower is not None:
        shapes[INT8] = shape  # for the choice of build: the engine's int8 rows follow x's dtype
    for name, (k, n) in shapes.items():
        dtype = jnp.dtype(name.removesuffix(WIDE))
        quantized = name == INT8
        pair = name in DTYPES  # a layer's projections from one input, in one call (`_kernel`)
        kernels = {b: _kernel(b, pair) for b in builds}
        theirs = _xla(quantized, pair)
        weight = (
            rng.integers(-127, 128, (k, n)) if quantized else rng.standard_normal((k, n)) * 0.02
        )
        first = jax.device_put(weight.astype(dtype), device)
        weights: list[Weight] = list(cpu_caches.uncached_copies(first, sweep_bytes))
        if pair:  # one copy split at a time, so the sweep is never held twice over
            weights = [_halves(weights.pop()) for _ in range(len(weights))]
        copies = len(weights)
        rounds_at: dict[int, Rounds] = {}
        for m in rows:
            x = jax.device_put(rng.standard_normal((m, k)).astype(np.float32), device)
            x_model = x if quantized else x.astype(dtype)  # Linear's input on XLA's path
            ours = np.asarray(kernels[isa](x, weights[0]))
            _check_agree(ours, np.asarray(theirs(x_model, weights[0])))
            if narrower in kernels and not np.array_equal(kernels[narrower](x, weights[0]), ours):
                log.warning("the %s build's matmul differs from the %s build's", narrower, isa)
                del kernels[narrower]
                builds.remove(narrower)
            passes = [_timed_pass(lambda w, f=f, x=x: f(x, w), weights) for f in kernels.values()]
            xla_pass = _timed_pass(lambda w, x=x_model, f=theirs: f(x, w), weights)
            rounds_at[m] = Rounds(passes, xla_pass)
            rounds_at[m].run(rounds)
        for m in disputed({m: r.best_ratio() for m, r in rounds_at.items()}):
            rounds_at[m].run(AGAIN * rounds)
        times[name] = {m: r.seconds(copies) for m, r in rounds_at.items()}
    if len(builds) == 1:  # none, or one that differed somewhere: trusted nowhere
        times = {name: {m: t[:2] for m, t in by_rows.items()} for name, by_rows in times.items()}
    return times


class Rounds:
    """One row count's timing: rounds of each kernel's pass and XLA's back to back, each round's
    ratios noted, and XLA's fastest pass (a disputed row count runs more, `AGAIN`)."""

    def __init__(self, passes: list[Callable[[], float]], xla_pass: Callable[[], float]):
        self.passes, self.xla_pass = passes, xla_pass
        self.ratios: list[list[float]] = [[] for _ in passes]
        self.fastest = float("inf")

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            kernel_s = [timed() for timed in self.passes]
            xla_s = self.xla_pass()
            for r, t in zip(self.ratios, kernel_s, strict=True):
                r.append(t / xla_s)
            self.fastest = min(self.fastest, xla_s)

    def best_ratio(self) -> float:
        return min(statistics.median(r) for r in self.ratios)

    def seconds(self, copies: int) -> tuple[float, ...]:
        """Per call: the build's kernel, XLA's dot, then the narrower kernel's if timed."""
        kernel_s = [statistics.median(r) * self.fastest / copies for r in self.ratios]
        return (kernel_s[0], self.fastest / copies, *kernel_s[1:])


def _kernel(isa: str, pair: bool = False) -> Callable[[jax.Array, Weight], jax.Array]:
    """The build's product of x by a weight, or by a pair of weights in the one call a layer's
    projections from one input take (`native_binding.matmuls`), their outputs side by side."""
    if not pair:
        targets = native_binding.targets(isa)
        return jax.jit(lambda x, w: native_binding.matmul(targets, x, w))
    several = native_binding.targets(isa, native_binding.SEVERAL)
    return jax.jit(lambda x, w: jnp.concatenate(native_binding.matmuls(several, x, w), axis=1))


def _halves(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    return w[:, : w.shape[1] // 2], w[:, w.shape[1] // 2 :]


def _xla(quantized: bool, pair: bool) -> Callable[[jax.Array, Weight], jax.Array]:
    """XLA's dot as `Linear` runs it: per weight (each of a pair its own dot, as the layer's
    projections are on XLA's path), blockwise for an int8 weight."""
    if quantized:
        return jax.jit(xla_int8_matmul)
    if pair:
        return jax.jit(lambda x, w: jnp.concatenate([xla_matmul(x, wi) for wi in w], axis=1))
    return jax.jit(xla_matmul)


def _check_agree(native_y: np.ndarray, xla_y: np.ndarray) -> None:
    """RuntimeError unless the two products agree (to bf16 rounding of XLA's input): a kernel
    that computes something else must not win on speed."""
    if not np.allclose(native_y, xla_y.astype(np.float32), rtol=2e-2, atol=2e-2):
        worst = float(np.max(np.abs(native_y - xla_y.astype(np.float32))))
        raise RuntimeError(f"native matmul calibration: the kernel and XLA's dot differ by {worst}")


def _timed_pass(product: Callable[[Weight], jax.Array], weights: list[Weight]):
    """A function timing one pass of `product` over every weight (compiled and warmed here)."""
    jax.block_until_ready([product(w) for w in weights])

    def timed() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready([product(w) for w in weights])
        return time.perf_counter() - t0

    return timed
