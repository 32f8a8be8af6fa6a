"""A decode step's few rows times a weight, by the native CPU kernel (`matmul.cc`, beside this
file).

XLA:CPU's GEMM libraries pack the weight before multiplying, which at 2 to 32 rows costs more
than the multiply: the kernel instead streams the `[in, out]` weight once, in panels that stay
in L1 while every row is multiplied into them (see the source for the measurements). A bf16
weight is widened as it is read, so it streams half the bytes; an int8 (quantized) weight a
quarter, its scales applied by the caller. Each output is summed over `in`
in order, so a row's result does not depend on its batch. This module imports nothing from
flipjax.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kernels_pallas import native

HANDLERS = {
    jnp.dtype(jnp.float32): "matmul",
    jnp.dtype(jnp.bfloat16): "matmul_bf16",
    jnp.dtype(jnp.int8): "matmul_int8",
}
# Several weights of one dtype times one x in a call (`matmuls`).
SEVERAL = {jnp.dtype(jnp.float32): "matmuls", jnp.dtype(jnp.bfloat16): "matmuls_bf16"}


def targets(
    isa: str | None = None, handlers: dict[jnp.dtype, str] = HANDLERS
) -> dict[jnp.dtype, str]:
    """The FFI target for each weight dtype (of `handlers`: `HANDLERS`, or `SEVERAL` for
    `matmuls`), built for `isa` (see `native.ISAS`; default `native.build_isa()`) and registered
    on first use."""
    return {dtype: native.target(name, isa) for dtype, name in handlers.items()}


def matmul(targets: dict[jnp.dtype, str], x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] float32 @ w [K, N], float32, bfloat16 or int8 (widened exactly, accumulated
    in fp32), by the FFI target `targets` (see `targets()`) names for w's dtype; [M, N] float32."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(f"native matmul: need x [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.dtype != jnp.float32 or w.dtype not in targets:
        raise ValueError(
            f"native matmul: x must be float32 and w one of {sorted(map(str, targets))}, "
            f"got {x.dtype} and {w.dtype}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(targets[w.dtype], out)(x, w)


def matmuls(
    targets: dict[jnp.dtype, str], x: jax.Array, weights: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
    """`x @ w` for each of `weights` ([K, N_i], all float32 or all bfloat16), in one call of the
    FFI target `targets` (`targets(handlers=SEVERAL)`) names for their dtype: each [M, N_i]
    float32, bit for bit `matmul`'s product of that weight."""
    if not weights:
        raise ValueError("native matmuls: need at least one weight")
    dtypes = {w.dtype for w in weights}
    if x.ndim != 2 or x.dtype != jnp.float32 or len(dtypes) != 1 or dtypes - set(targets):
        raise ValueError(
            f"native matmuls: x must be float32 [M, K] and the weights all one of "
            f"{sorted(map(str, targets))}, got {x.dtype} {x.shape} and {sorted(map(str, dtypes))}"
        )
    for w in weights:
        if w.ndim != 2 or w.shape[0] != x.shape[1] or w.shape[0] == 0:
            raise ValueError(f"native matmuls: need weights [K, N] for x {x.shape}, got {w.shape}")
    outs = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in weights)
    return tuple(jax.ffi.ffi_call(targets[weights[0].dtype], outs)(x, *weights))
