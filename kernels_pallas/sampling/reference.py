"""Each row's first maximum in pure JAX: the token of a greedy or a Gumbel-max draw. This module
imports nothing from flipjax."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_max(x: jax.Array) -> jax.Array:
    """Index of each row's first maximum, as `jnp.argmax` gives it (a NaN counts as the maximum).

    Two vectorised reductions (max, then the least index that reaches it): XLA:CPU's
    argmax reduces value-index pairs one element at a time, about 4x slower over a 32k vocabulary
    (2.3 -> 0.5 ms at 32 rows).
    """
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)  # XLA:CPU's max may skip NaNs
    ids = jnp.arange(v, dtype=jnp.int32)
    # A NaN ranks by its index, a maximum by its index + v: one reduction finds either.
    rank = jnp.where(jnp.isnan(x), ids, jnp.where(x == top, ids + v, 2 * v))
    first = jnp.min(rank, axis=-1)
    return jnp.where(first >= v, first - v, first).astype(jnp.int32)
