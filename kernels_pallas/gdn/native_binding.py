"""The gated delta rule over pooled states (decode, verify and prefill steps), the causal conv
before it over pooled conv windows, and the gated norm after it, by native CPU kernels.

`gdn_decode.cc` (beside this file) reads each row's state straight from its slot and writes
the new one back in place; XLA's form of the same step gathers, decays, reduces and scatters in
about eight passes over memory.
The inputs are prepared here exactly as `reference` prepares them, so the kernel computes
`delta_rule_step`'s arithmetic on the same values. This module imports nothing from flipjax.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
    """Advance each row's pooled state by its tokens, in slots.

    pool: [S, Hv, dk, dv] fp32; reads: [B], the slot each row starts from (outside [0, S): a
    zero state); writes: [B] for one token per row, the slot its new state goes to, or [B, T]
    for T, the slot the state after each token goes to (a speculative verify step's chain, or
    a prefill chunk's own slot at every token; outside [0, S): dropped, and the row's output
    there and after is zero); q, k: [B, T, Hk,
    dk]; v: [B, T, Hv, dv]; g, beta: [B, T, Hv]; valid: [B, T]. Rows must write distinct
    slots. Returns o: [B, T, Hv, dv] fp32 and the pool with the new states (the input pool's
    buffer where it is donated).
    """
    if pool.dtype != jnp.float32:
        raise ValueError(f"gdn decode: the state pool must be float32, got {pool.dtype}")
    writes = writes[:, None] if writes.ndim == 1 else writes
    if writes.shape != q.shape[:2]:
        raise ValueError(f"gdn decode: writes {writes.shape} for tokens {q.shape[:2]}")
    q, k, v, g, beta = prepare(q, k, v, g, beta, valid)  # [B, H, T, ...]
    out, pool = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        input_output_aliases={0: 1},
    )(pool, reads.astype(jnp.int32), writes.astype(jnp.int32), q, k, v, jnp.exp(g), beta)
    return jnp.swapaxes(out, 1, 2), pool


def pooled_conv(
    target: str,
    pool: jax.Array,
    reads: jax.Array,
    writes: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    valid: jax.Array,
    columns: Sequence[int] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The causal conv and SiLU over each row's pooled conv window, in slots
    (`conv_pool.cc`, beside this file).

    pool: [S, K-1, C] fp32, each slot a row's last K-1 conv inputs; reads, writes: [B], the
    slot each row's window comes from and the one its new window goes to (outside [0, S): a zero
    window, and dropped); x: [B, T, C] fp32, or [B, T, W] with `columns` (int [C], static):
    channel i of a token is its column columns[i] (read in place, not copied out first); weight:
    [C, K]; valid: [B, T], each row's real tokens first. Rows must write distinct slots and read
    none but their own. Returns y: [B, T, C], as `causal_conv` computes it, and the pool with each
    row's new window (the input pool's buffer where it is donated).
    """
    if pool.dtype != jnp.float32 or x.dtype != jnp.float32:
        raise ValueError(f"conv pool: the pool and x must be float32, got {pool.dtype}, {x.dtype}")
    channels = pool.shape[-1]
    columns = np.arange(x.shape[-1]) if columns is None else np.asarray(columns)
    if columns.shape != (channels,) or not ((0 <= columns) & (columns < x.shape[-1])).all():
        raise ValueError(
            f"conv pool: need a column of x's {x.shape[-1]} for each of the pool's {channels} "
            f"channels, got columns of shape {columns.shape}"
        )
    lengths = jnp.sum(valid.astype(jnp.int32), axis=1)
    y, pool = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct((*x.shape[:2], channels), jnp.float32),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ),
        input_output_aliases={0: 1},
    )(
        pool,
        reads.astype(jnp.int32),
        writes.astype(jnp.int32),
        x,
        jnp.asarray(columns, jnp.int32),
        weight.astype(jnp.float32),
        lengths,
    )
    return y, pool


def gated_norm(target: str, x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The GDN output norm `(weight * rmsnorm(x)) * silu(z)` over the last dimension, as
    `RMSNormGated` computes it in fp32 (`gated_norm.cc`, beside this file): x, z [..., D] fp32,
    weight [D]. Returns [..., D] fp32."""
    if x.dtype != jnp.float32 or z.dtype != jnp.float32:
        raise ValueError(f"gated norm: x and z must be float32, got {x.dtype}, {z.dtype}")
    if x.ndim < 1 or x.shape != z.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"gated norm: need x and z of one shape [..., D] and weight [D], got "
            f"{list(x.shape)}, {list(z.shape)} and {list(weight.shape)}"
        )
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x, z, weight.astype(jnp.float32), eps=np.float32(eps)
    )
