"""The product `Linear` runs where the native matmul does not: XLA's own dot.

It lives beside the kernel so that the model, the benchmark and the calibration that chooses
between the two (`calibration.py`) all run the same form. This module imports nothing from
flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def xla_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] by XLA's dot, in x's dtype.

    fp32 weights multiply as they are. Low-precision weights accumulate in fp32 (XLA:CPU runs
    bf16 x bf16 -> bf16 about 10x slower than the same product accumulated in fp32), and on the
    CPU a single row is padded to two: one row takes XLA's matvec path, which has no fast bf16
    kernel.
    """
    if w.dtype == jnp.float32:
        return jnp.einsum("...i,io->...o", x, w)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 1 and jax.default_backend() == "cpu":
        rows = jnp.concatenate([rows, rows])
    y = jnp.einsum("ri,io->ro", rows, w, preferred_element_type=jnp.float32)[:n]
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[1])
