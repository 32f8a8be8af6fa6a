"""Rows written into an array in place, and read from it, by the native CPU kernels
(`page_writes.cc` beside this file).

XLA:CPU lowers a scatter into a bfloat16 or float8 array by converting the whole operand to
float32 and back, so writing a step's few K/V rows into a page pool that way copies the pool
twice. The kernel's output is aliased to the pool, so with the pool donated only the rows move.
Its gather from such a pool inside attention's block loop widens the whole pool once per call;
the read kernel copies the rows alone. This module imports nothing from flipjax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_pallas import native


def write_rows(pool: jax.Array, rows: jax.Array, ids: jax.Array) -> jax.Array:
    """pool.at[ids].set(rows.astype(pool.dtype), mode="drop") done in place by the native
    kernel: pool [*lead, *row], rows [N, *row] (any dtype; cast to pool's), ids int [N] into
    the A = prod(lead) rows of the pool taken in order (so a pool [P, S, H, D] takes token rows
    [N, H, D] at page * S + slot, or pages [N, S, H, D] at page, without a reshape: XLA copies
    a reshaped operand it must alias); an id outside [0, A) is dropped. A negative id is
    dropped too, where jnp's scatter counts it from the end unless given
    `wrap_negative_indices=False`; and a wide id is not wrapped into int32 range, as jnp's is.
    Of duplicate ids the last row wins. Returns the new pool (XLA aliases it to `pool`'s
    buffer, so with `pool` donated nothing is copied; without, XLA copies the pool first and
    `pool` is left as it was)."""
    lead = pool.ndim - (rows.ndim - 1)
    if (
        rows.ndim < 1
        or lead < 1
        or rows.shape[1:] != pool.shape[lead:]
        or ids.shape != rows.shape[:1]
    ):
        raise ValueError(
            f"write rows: need pool [*lead, *row], rows [N, *row] and ids [N], got pool "
            f"{list(pool.shape)}, rows {list(rows.shape)} and ids {list(ids.shape)}"
        )
    if jax.dtypes.itemsize_bits(pool.dtype) % 8:
        raise ValueError(f"write rows: a pool of {pool.dtype} packs elements below a byte")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"write rows: ids must be integers, got {ids.dtype}")
    if jnp.iinfo(ids.dtype).max > jnp.iinfo(jnp.int32).max:
        # The kernel takes int32 ids: a wider one out of range must stay out of range, not wrap.
        low = -1 if jnp.issubdtype(ids.dtype, jnp.signedinteger) else 0
        ids = jnp.clip(ids, low, math.prod(pool.shape[:lead]))
    return jax.ffi.ffi_call(
        native.target("write_rows"),
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={0: 0},
    )(pool, rows.astype(pool.dtype), ids.astype(jnp.int32))


def read_rows(pool: jax.Array, ids: jax.Array) -> jax.Array:
    """pool[ids] by the native kernel, without widening the pool: pool [A, *row], ids int of
    any shape -> [*ids.shape, *row]; an id outside [0, A) reads zeros."""
    if pool.ndim < 1 or jax.dtypes.itemsize_bits(pool.dtype) % 8:
        raise ValueError(f"read rows: need a pool [A, *row] of whole bytes, got {pool.shape}")
    return jax.ffi.ffi_call(
        native.target("read_rows"), jax.ShapeDtypeStruct((*ids.shape, *pool.shape[1:]), pool.dtype)
    )(pool, jnp.clip(ids, -1, pool.shape[0]).astype(jnp.int32))
