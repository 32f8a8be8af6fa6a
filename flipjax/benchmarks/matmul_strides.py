"""`python -m flipjax.bench matmul --strides`: what a weight's row stride costs the native matmul.

A weight's rows lie `N * itemsize` bytes apart. L1 picks a line's set by its address within a
4 KB page, so where that stride is a multiple of 4 KB (the MLP's [768, 2048] in fp32) every row
of a column falls into one set, and where it is a multiple of 1 KB (every width of the
benchmark model that is a multiple of 256) into at most four. The native matmul reads a weight
a column sub-tile of many rows at a time, so such a stride may cost it, and a weight one cache
line wider does not share it. For each such weight shape of the benchmark model and each row
count, the native matmul runs on the weight and on that wider peer in turns (whose order
alternates every round, so that a slow spell of the machine slows both), and the peer's rate
per byte is reported over the weight's: above 1, the stride costs that much.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cpu_caches import uncached_copies
from kernels_pallas.matmul import native_binding as dense_native

CACHE_LINE_BYTES = 64


def line_wider(n: int, itemsize: int) -> int:
    """`n` columns and a cache line's more: rows of the wider weight are `n * itemsize + 64`
    bytes apart, never a multiple of 1 KB where `n * itemsize` is one."""
    if n <= 0 or itemsize <= 0 or CACHE_LINE_BYTES % itemsize:
        raise ValueError(f"line_wider: need n > 0 and an itemsize dividing 64, got {n}, {itemsize}")
    return n + CACHE_LINE_BYTES // itemsize


def paired_seconds(
    first: Callable[[], None], second: Callable[[], None], rounds: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """The median seconds of `first()` and of `second()` over `rounds` rounds, each running both
    in turn, `second` first in every other round."""
    if rounds < 1:
        raise ValueError(f"paired_seconds: rounds must be at least 1, got {rounds}")
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            t0 = clock()
            (first, second)[which]()
            times[which].append(clock() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def report(shapes: list[tuple[int, int]], rows: list[int], dtype: jnp.dtype, rounds: int) -> None:
    """The table of `--strides` (see the module's docstring)."""
    targets = dense_native.targets()
    product = jax.jit(lambda x, w: dense_native.matmul(targets, x, w))
    rng = np.random.default_rng(0)
    print(f"{'x @ w':>24} {'GB/s':>6} {'wider peer':>16} {'GB/s':>6} {'peer / w':>9}")
    for k, n in shapes:
        if (n * dtype.itemsize) % 1024:
            continue  # rows already spread over L1's sets: no stride to weigh
        wide = line_wider(n, dtype.itemsize)
        weights = uncached_copies(jnp.asarray(rng.normal(0, 0.02, (k, n)), dtype))
        peers = uncached_copies(jnp.asarray(rng.normal(0, 0.02, (k, wide)), dtype))
        for m in rows:
            x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)

            def sweep(ws: list[jax.Array], x: jax.Array = x) -> Callable[[], None]:
                return lambda: jax.block_until_ready([product(x, w) for w in ws])

            sweep(weights)()  # compiles both shapes before the clock starts
            sweep(peers)()
            t_w, t_peer = paired_seconds(sweep(weights), sweep(peers), rounds, time.perf_counter)
            rate = dtype.itemsize * k * n * len(weights) / t_w / 1e9
            peer_rate = dtype.itemsize * k * wide * len(peers) / t_peer / 1e9
            print(
                f"{f'[{m},{k}] x [{k},{n}]':>24} {rate:>6.1f} {f'[{k},{wide}]':>16} "
                f"{peer_rate:>6.1f} {peer_rate / rate:>8.2f}x"
            )
