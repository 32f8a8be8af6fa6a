"""A verify step's tokens with the MTP head's drafts taken on the device.

The head drafts right behind a verify step (`Drafter.draft_verified`); feeding those drafts to
the next verify step where they are lets the host dispatch that step while the head still runs,
as a plain decode step is fed by the previous one's sampled ids (`flipjax.engine.overlap`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def fed_tokens(
    tokens: jax.Array, drafts: jax.Array, source: jax.Array, counts: jax.Array
) -> jax.Array:
    """tokens [B, K + 1] (each row's pending token, then drafts known on the host), with row
    i's columns 1..counts[i] taken from row source[i] of drafts [B, K] where source[i] >= 0."""
    column = jnp.arange(tokens.shape[1])[None]
    shifted = jnp.pad(jnp.take(drafts, jnp.maximum(source, 0), axis=0), ((0, 0), (1, 0)))
    take = (source[:, None] >= 0) & (column >= 1) & (column <= counts[:, None])
    return jnp.where(take, shifted, tokens)
