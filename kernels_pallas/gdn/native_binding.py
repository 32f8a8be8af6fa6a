"""One decode token of the gated delta rule over pooled states, by the native CPU kernel.

`gdn_decode.cc` (beside this file) reads each row's state straight from its slot and writes
the new one back in place; XLA's form of the same step gathers, decays, reduces and scatters in
about eight passes over memory.
The inputs are prepared here exactly as `reference` prepares them, so the kernel computes
`delta_rule_step`'s arithmetic on the same values. This module imports nothing from flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.gdn.reference import prepare


def pooled_decode(
    target: str,
    pool: jax.Array,
    reads: jax.Array,
    writes: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Advance each row's pooled state by its one token, in its slot.

    pool: [S, Hv, dk, dv] fp32; reads: [B], the slot each row starts from (outside [0, S): a
    zero state); writes: [B], the slot its new state goes to (outside [0, S): dropped, and the
    row's output is zero); q, k: [B, 1, Hk, dk]; v: [B, 1, Hv, dv]; g, beta: [B, 1, Hv];
    valid: [B, 1]. Rows must write distinct slots. Returns o: [B, 1, Hv, dv] fp32 and the
    pool with the rows' new states (the input pool's buffer where it is donated).
    """
    if pool.dtype != jnp.float32:
        raise ValueError(f"gdn decode: the state pool must be float32, got {pool.dtype}")
    q, k, v, g, beta = (a[:, :, 0] for a in prepare(q, k, v, g, beta, valid))
    out, pool = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        input_output_aliases={0: 1},
    )(pool, reads.astype(jnp.int32), writes.astype(jnp.int32), q, k, v, jnp.exp(g), beta)
    return out[:, None], pool
