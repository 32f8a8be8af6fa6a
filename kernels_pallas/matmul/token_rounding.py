"""W8A8 activations: each token rounded to int8 steps of its own scale, as compressed-tensors'
int8 checkpoints define them. This module imports nothing from flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_tokens_to_int8(x: jax.Array) -> jax.Array:
    """Each token's (row's) values rounded to int8 steps of its own scale, and back: the
    dynamic per-token activation scheme of W8A8 checkpoints (compressed-tensors' symmetric
    int8: the scale is the row's largest magnitude over 127.5, values clamped to [-128, 127])."""
    # Both divisions are IEEE divisions, as the checkpoint's reference runs them: XLA would
    # multiply by a reciprocal instead (one ulp off), and a row's peak, exactly 127.5 steps
    # away, would round to the other side of the tie. The barriers hide the divisors from it.
    peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = peak / jax.lax.optimization_barrier(jnp.full(peak.shape, 127.5, x.dtype))
    scale = jnp.where(scale == 0, jnp.ones_like(scale), scale)
    steps = x / jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
    return jnp.clip(jnp.round(steps), -128, 127) * scale
