"""Rows sorted by group times their group's weight, by the native CPU kernel
(`ragged_matmul.cc`, beside this file): `jax.lax.ragged_dot`'s product, reading only the weights
of groups that have rows. A bf16 or int8 weight is widened as it is read. Each row is summed
over `in` in order, so its result depends on neither its group's size nor the batch. This
module imports nothing from flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import native

HANDLERS = {
    jnp.dtype(jnp.float32): "ragged_matmul",
    jnp.dtype(jnp.bfloat16): "ragged_matmul_bf16",
    jnp.dtype(jnp.int8): "ragged_matmul_int8",
}


def targets(isa: str | None = None) -> dict[jnp.dtype, str]:
    """The FFI target for each weight dtype, built for `isa` (see `native.ISAS`; default
    `native.build_isa()`) and registered on first use."""
    return {dtype: native.target(name, isa) for dtype, name in HANDLERS.items()}


def ragged_matmul(
    targets: dict[jnp.dtype, str], x: jax.Array, w: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """x [M, K] float32, its rows sorted by group, @ w [G, K, N] (float32, bfloat16 or int8,
    widened exactly and accumulated in fp32) with group_sizes [G]: row r of group g is x[r] @ w[g];
    rows past the groups' total are zero. By the FFI target `targets` names for w's dtype;
    [M, N] float32."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or w.shape[1] == 0:
        raise ValueError(
            f"native ragged matmul: need x [M, K] and w [G, K, N], got {x.shape} and {w.shape}"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"native ragged matmul: group_sizes must be [{w.shape[0]}], got {group_sizes.shape}"
        )
    if x.dtype != jnp.float32 or w.dtype not in targets:
        raise ValueError(
            f"native ragged matmul: x must be float32 and w one of "
            f"{sorted(map(str, targets))}, got {x.dtype} and {w.dtype}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(targets[w.dtype], out)(x, w, group_sizes.astype(jnp.int32))
