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


def xla_int8_matmul(x: jax.Array, q: jax.Array, max_blocks: int = 8) -> jax.Array:
    """x [M, K] @ q [K, N] (int8) by XLA's dot, in x's dtype accumulated in fp32, float32.

    XLA's dot takes the weight in x's dtype, so the weight is widened a block of columns at a
    time inside a loop: the widened copy alive at once is one block (a `max_blocks`-th of the
    weight), never the whole weight. Unrolled, XLA widens every block before the first product
    (an optimization barrier between them does not survive its passes); the loop costs the
    GEMM about a quarter of its rate at prefill's row counts.
    """
    n = q.shape[1]
    width = -(-n // max_blocks)
    blocks = -(-n // width)
    # A last block past N starts earlier instead (a dynamic slice clamps its start), and writes
    # again the columns it shares with the block before: the same values.

    def block(j: jax.Array, y: jax.Array) -> jax.Array:
        part = jax.lax.dynamic_slice_in_dim(q, j * width, width, axis=1).astype(x.dtype)
        product = jnp.einsum("ri,io->ro", x, part, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(y, product, j * width, axis=1)

    y = jnp.zeros((x.shape[0], n), jnp.float32)
    return jax.lax.fori_loop(0, blocks, block, y) if blocks > 1 else block(0, y)
