"""Each row's first maximum by the native CPU kernel (`first_max.cc`, beside this file): one read
of a row for its maximum and one up to where it first occurs. This module imports nothing from
flipjax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import native

INT32_MAX = 2**31 - 1


def first_max(x: jax.Array, isa: str | None = None) -> jax.Array:
    """x float32 [*lead, V] -> int32 [*lead]: `reference.first_max(x)`, index for index (NaNs,
    ties, infinities and signed zeros alike), by the kernel built for `isa` (see
    `native.ISAS`; default `native.build_isa()`)."""
    if x.ndim < 1 or not 0 < x.shape[-1] <= INT32_MAX:
        raise ValueError(f"first max: need x [*lead, V] with 0 < V < 2^31, got {list(x.shape)}")
    if x.dtype != jnp.float32:
        raise ValueError(f"first max: the kernel takes float32, got {x.dtype}")
    # Leading dimensions are rows to the kernel, so a vmapped call is one call over them all.
    return jax.ffi.ffi_call(
        native.target("first_max", isa),
        jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),
        vmap_method="broadcast_all",
    )(x)
