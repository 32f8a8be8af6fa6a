"""What this machine can do at best: copy bandwidth, matvec time over N bytes, matmul FLOP/s.

Measured in the same run as the thing they bound, because shared machines drift. A decode
step reads its weights from memory, so the products that bound it are timed over distinct
copies spanning more than the last-level cache (`kernels_pallas.cpu_caches`): on a CPU whose
cache holds the weight, timing one weight again and again measures the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_caches
from kernels_pallas.matmul import calibration
from kernels_pallas.matmul import native_binding as matmul_native


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    """Fastest wall time of `fn()` (blocked until ready) over `repeats` runs, after one warm-up."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gbs(nbytes: int = 512 << 20) -> float:
    """Bytes read plus written per second by an on-device array copy. The input is donated, so
    each pass writes into memory already mapped: a fresh output buffer per pass timed the
    kernel's page faults (5-8 GB/s on machines whose matvec streams at 30)."""
    scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    state = [jnp.ones((nbytes // 4,), jnp.float32)]

    def one_pass() -> jax.Array:
        state[0] = scale(state[0])
        return state[0]

    return 2 * nbytes / best_of(one_pass) / 1e9


def sweep_seconds(product: Callable[[jax.Array], jax.Array], weights: list[jax.Array]) -> float:
    """Fastest time of `product(w)` per weight, over passes through every copy in `weights`."""
    return best_of(lambda: [product(w) for w in weights]) / len(weights)


def matvec_seconds(nbytes: int, width: int = 768, dtype: jnp.dtype = jnp.float32) -> float:
    """Time of one matrix-vector product over a `nbytes` matrix read from memory: the batch-1
    decode floor."""
    rows = nbytes // (jnp.dtype(dtype).itemsize * width)
    v = jnp.ones((_rows(1, dtype), width), dtype)
    mv = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return sweep_seconds(
        lambda w: mv(v, w), cpu_caches.uncached_copies(jnp.ones((width, rows), dtype) * 0.5)
    )


def gemm_flops(
    m: int, k: int = 768, n: int = 32000, dtype: jnp.dtype = jnp.float32, kernel: str = "xla"
) -> float:
    """FLOP/s of an [m, k] x [k, n] matmul with its weight read from memory: what a batch-m
    decode step's GEMMs can run at, by XLA's dot (`kernel="xla"`) or by the native matmul
    (`"native"`, from the build the calibration picked for `m` rows; the engine's `Linear` runs
    whichever this machine's calibration picked, so a bound should take the faster)."""
    weights = cpu_caches.uncached_copies(jnp.ones((k, n), dtype) * 0.5)
    if kernel == "native":
        targets = matmul_native.targets(calibration.native_build(dtype, m, columns=n))
        a = jnp.ones((m, k), jnp.float32)
        mm = jax.jit(lambda x, w: matmul_native.matmul(targets, x, w))
    else:
        a = jnp.ones((_rows(m, dtype), k), dtype)
        mm = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32))
    return 2 * m * k * n / sweep_seconds(lambda w: mm(a, w), weights)


def _rows(m: int, dtype: jnp.dtype) -> int:
    """The rows a product over `m` rows runs on, as `Linear` runs it: low precision accumulates
    in fp32 over at least two rows (see there)."""
    return m if jnp.dtype(dtype) == jnp.float32 else max(m, 2)


def matmul_tflops(n: int = 2048) -> float:
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    return 2 * n**3 / best_of(lambda: mm(a)) / 1e12
