"""One decode token of the gated delta rule over pooled states, by the native CPU kernel.

`cpu/gdn_decode.cc` reads each row's state straight from the slot pool and writes the new one
once; XLA's form of the same step gathers, decays and reduces in about six passes over memory.
The inputs are prepared here exactly as `gdn_reference` prepares them, so the kernel computes
`delta_rule_step`'s arithmetic on the same values. This module imports nothing from flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import prepare


def pooled_decode(
    target: str,
    pool: jax.Array,
    slots: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Advance each row's pooled state by its one token.

    pool: [S, Hv, dk, dv] fp32; slots: [B] (a slot outside [0, S) starts from a zero state);
    q, k: [B, 1, Hk, dk]; v: [B, 1, Hv, dv]; g, beta: [B, 1, Hv]; valid: [B, 1].
    Returns o: [B, 1, Hv, dv] fp32 and the rows' new states [B, Hv, dk, dv] (the pool is
    left as it was).
    """
    q, k, v, g, beta = (a[:, :, 0] for a in prepare(q, k, v, g, beta, valid))
    rows = q.shape[0]
    out, state = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
            jax.ShapeDtypeStruct((rows, *pool.shape[1:]), jnp.float32),
        ),
    )(pool.astype(jnp.float32), slots.astype(jnp.int32), q, k, v, jnp.exp(g), beta)
    return out[:, None], state
