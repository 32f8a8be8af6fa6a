"""The gated delta rule in pure JAX: the recurrent and the chunkwise (WY/UT) form.

These are the references every GDN kernel in this folder (`pallas_kernel`, and the native
`gdn_decode.cc` through `native_binding`) is checked against, and what the model runs when the
dispatch selects the references. They carry the recurrent state explicitly (in and out) so that
prefill, chunked prefill and decode continue one another exactly. This module imports nothing
from flipjax.

Padding convention: `valid[b, t]` marks real tokens and is a right-padded prefix per row. A padded
token has beta = 0 and g = 0, so it neither decays nor writes the state. Never drop the fp32
casts: the state recurrence is unstable in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK_SIZE = 64
_HI = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, valid: jax.Array
) -> tuple[jax.Array, ...]:
    """Repeat key heads to value heads, normalise, mask padding; all fp32, head-major."""
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:
        # Each key head serves hv // hk consecutive value heads.
        q = jnp.repeat(q, hv // hk, axis=2)
        k = jnp.repeat(k, hv // hk, axis=2)
    f32 = jnp.float32
    q = l2norm(q.astype(f32)) * (q.shape[-1] ** -0.5)
    k = l2norm(k.astype(f32))
    v = v.astype(f32)
    g = jnp.where(valid[:, :, None], g.astype(f32), 0.0)
    beta = jnp.where(valid[:, :, None], beta.astype(f32), 0.0)
    # -> [B, H, T, d] and [B, H, T]
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    g, beta = (jnp.swapaxes(a, 1, 2) for a in (g, beta))
    return q, k, v, g, beta


def delta_rule_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence on prepared inputs.

    q, k: [B, H, dk]; v: [B, H, dv]; g, beta: [B, H]; state: [B, H, dk, dv].
    """
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", state, k, precision=_HI)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("bhkv,bhk->bhv", state, q, precision=_HI)
    return out, state


def delta_rule_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token gated delta rule.

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g, beta: [B, T, Hv]; state: [B, Hv, dk, dv] fp32;
    valid: [B, T]. Returns o: [B, T, Hv, dv] fp32 and the final state.
    """
    q, k, v, g, beta = prepare(q, k, v, g, beta, valid)

    def body(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        o, s = delta_rule_step(*xs, s)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(body, state.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1), state  # [B, T, H, dv]


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by matrix products only.

    Blockwise, as LAPACK's own triangular inverse is: diagonal blocks of size 1, 2, 4, ... are
    joined in pairs, the inverse of [[A, 0], [M, B]] being [[A', 0], [-B' M A', B']] with A', B'
    the blocks' inverses. Every level is batched matmuls, about one C x C product in all, and
    as accurate as substitution (a power series of L is not: its powers grow where the rule
    has no decay). Not `lax.linalg.triangular_solve`: on the CPU its batched LAPACK kernel
    fans out into XLA's intra-op thread pool from a thread of that pool and waits, so two
    solves running at once on a two-thread pool wait for each other forever (a training step
    stalled at 0% CPU that way).
    """
    c = strict.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()
    batch = strict.shape[:-2]
    pad = [(0, 0)] * len(batch) + [(0, size - c), (0, size - c)]
    lower = jnp.pad(strict, pad)
    blocks = jnp.ones((*batch, size, 1, 1), strict.dtype)  # the diagonal blocks' inverses
    b = 1
    while b < size:
        pairs = size // (2 * b)
        # The lower-left block under each pair of diagonal blocks: [..., pairs, b, b].
        grid = lower.reshape(*batch, pairs, 2, b, pairs, 2, b)
        below = jnp.moveaxis(jnp.diagonal(grid, axis1=-6, axis2=-3), -1, -5)[..., 1, :, 0, :]
        first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        joined = -jnp.matmul(jnp.matmul(second, below, precision=_HI), first, precision=_HI)
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        bottom = jnp.concatenate([joined, second], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)
        b *= 2
    return blocks[..., 0, :c, :c]


def delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    valid: jax.Array,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Chunkwise-parallel gated delta rule (WY/UT form); same contract as the recurrent form.

    Inside a chunk the delta updates form a unit lower-triangular system (I + M) U = rhs; solving
    it turns C sequential rank-1 updates into matmuls. Chunks then pass the state in a scan.
    """
    q, k, v, g, beta = prepare(q, k, v, g, beta, valid)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk_size
    if pad:
        # Padded tokens have g = beta = 0 (identity on the state) and are sliced off below.
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    n = (t + pad) // chunk_size
    c = chunk_size

    def chunks(a: jax.Array) -> jax.Array:
        return a.reshape(b, h, n, c, *a.shape[3:])

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))

    mm = dict(precision=_HI)
    ut = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k, **mm) * decay
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    strict = jnp.where(jnp.tril(causal, -1), ut, 0.0)
    solved = jnp.einsum("bhnij,bhnjd->bhnid", unit_lower_inverse(strict), rhs, **mm)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
    intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k, **mm) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_to_end = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    def body(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        nv, kc, qd, ia, ke, cd = xs
        v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, s, **mm)
        o = jnp.einsum("bhck,bhkv->bhcv", qd, s, **mm) + jnp.einsum(
            "bhij,bhjv->bhiv", ia, v_new, **mm
        )
        s = s * cd[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", ke, v_new, **mm)
        return s, o

    xs = tuple(
        jnp.moveaxis(a, 2, 0)
        for a in (new_values, k_cumdecay, q_decayed, intra, k_to_end, chunk_decay)
    )
    state, out = jax.lax.scan(body, state.astype(jnp.float32), xs)  # out: [N, B, H, C, dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.swapaxes(out, 1, 2), state
