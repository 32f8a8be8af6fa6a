"""A decode step's few rows times a weight, by the native CPU kernel (`cpu/matmul.cc`).

XLA:CPU's GEMM libraries pack the weight before multiplying, which at 2 to 16 rows costs more
than the multiply: the kernel instead streams the `[in, out]` weight once, in panels that stay
in L1 while every row is multiplied into them (see the source for the measurements). Each
output is summed over `in` in order, so a row's result does not depend on its batch. This
module imports nothing from flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul(target: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N], both float32, by the FFI target `target`; [M, N] float32."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(f"native matmul: need x [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"native matmul: x and w must be float32, got {x.dtype} and {w.dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, w)
