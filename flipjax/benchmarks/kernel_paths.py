"""Which kernels the benchmarks' steps run, as a one-device decode step picks them, and the
build they come from: printed beside the numbers so a rate is never read without its path."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.matmul import calibration


def native_matmul_picked(rows: int, columns: int, dtype: jnp.dtype) -> bool:
    """Whether a one-device decode step in `native` mode runs this product natively."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with dispatch.kernels("native"), head_parallel.across(mesh):
        return dispatch.matmul(rows, columns, dtype) is not None


def kernel_paths(batches: list[int], dtype: jnp.dtype, moe: bool) -> str:
    """Which kernels a one-device decode step runs, and the build they come from."""
    mode = dispatch.current_mode()
    if mode != "native":
        return f"kernels: {mode} (the native CPU kernels do not run)"
    isa = native.build_isa()
    vectors = _vectors(isa, native.cpu_flags())
    paths = [f"kernels: native, built for {isa} ({vectors}); decode attention and GDN: native"]
    source = calibration.ROWS_ENV if os.environ.get(calibration.ROWS_ENV) else "calibrated here"
    wide = calibration.WIDE_COLUMNS
    choice = {name: calibration.native_rows(name, isa) for name in calibration.DTYPES}
    choice |= {n + calibration.WIDE: calibration.native_rows(n, isa, wide) for n in choice}
    narrower = None if source != "calibrated here" else calibration.calibrated(isa).narrower
    paths.append(f"native matmul {calibration.describe(choice, narrower)} ({source})")
    for batch in batches:
        ways = [_way(batch, n, dtype, isa) for n in (768, wide)]
        paths.append(f"batch {batch} matmuls: {ways[0]}, lm head: {ways[1]}")
    if moe:
        paths.append("experts: native grouped matmul")
    return "; ".join(paths)


def _way(batch: int, columns: int, dtype: jnp.dtype, isa: str) -> str:
    """`XLA`, `native`, or `native (x86-64-v3 build)` where the narrower build runs it."""
    if not native_matmul_picked(batch, columns, dtype):
        return "XLA"
    build = calibration.native_build(dtype, batch, isa, columns)
    return "native" if build == isa else f"native ({build} build)"


def _vectors(isa: str, flags: set[str]) -> str:
    """The widest vector instructions a build for `isa` uses on a CPU with `flags`."""
    if isa == "native":
        isa = "x86-64-v4" if "avx512f" in flags else "x86-64-v3" if "avx2" in flags else ""
    return {"x86-64-v4": "AVX-512", "x86-64-v3": "AVX2", "x86-64-v2": "SSE4.2"}.get(isa, "SSE")
