"""Pallas kernels for the gated delta rule: the chunkwise (WY/UT) prefill form and the one-step
decode update.

Both take the inputs `kernels_pallas.gdn.reference` prepares (key heads repeated to value
heads, q and k l2-normalised, q scaled, padding with g = beta = 0; all fp32, head-major) and the
fp32 state, and return outputs and the final state; `delta_rule_kernel` takes raw layer inputs
under the references' contract. `kernels_pallas.gdn.reference` holds the references. One
program owns one (request, value head): its [dk, dv] state stays in registers across the whole
sequence, so it is read and written once per call. This module imports nothing from flipjax.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.gdn.reference import prepare

CHUNK_SIZE = 64


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    return jax.lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _chunk_kernel(
    q_ref: Any,  # [T, dk]
    k_ref: Any,  # [T, dk]
    v_ref: Any,  # [T, dv]
    g_ref: Any,  # [T]
    beta_ref: Any,  # [T]
    state_ref: Any,  # [dk, dv]
    o_ref: Any,  # [T, dv]
    state_out_ref: Any,  # [dk, dv]
    *,
    chunk: int,
) -> None:
    c = chunk
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    causal = cols <= rows
    strict = cols < rows
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)

    def chunk_body(n: jax.Array, s: jax.Array) -> jax.Array:
        span = pl.ds(n * c, c)
        q, k, v = q_ref[span, :], k_ref[span, :], v_ref[span, :]
        g, beta = g_ref[span], beta_ref[span]
        # Inclusive cumsum of the log decays as a masked row sum (no scan primitive needed).
        cum = jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)
        total = jnp.sum(g)
        decay = jnp.where(causal, jnp.exp(cum[:, None] - cum[None, :]), 0.0)
        k_beta = k * beta[:, None]
        a = jnp.where(strict, _dot(k_beta, k, (1, 1)) * decay, 0.0)
        # Forward substitution for (I + A) U = rhs, A strictly lower: row i needs rows < i only.
        rhs_v = v * beta[:, None]
        rhs_k = k_beta * jnp.exp(cum)[:, None]

        def solve_row(i: jax.Array, us: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            u_v, u_k = us
            a_row = jnp.sum(jnp.where(row_ids == i, a, 0.0), axis=0)[:, None]  # [C, 1]
            at_i = row_ids == i
            u_v = u_v - jnp.where(at_i, jnp.sum(a_row * u_v, axis=0)[None, :], 0.0)
            u_k = u_k - jnp.where(at_i, jnp.sum(a_row * u_k, axis=0)[None, :], 0.0)
            return u_v, u_k

        new_values, k_cumdecay = jax.lax.fori_loop(1, c, solve_row, (rhs_v, rhs_k))
        v_new = new_values - _dot(k_cumdecay, s)
        intra = _dot(q, k, (1, 1)) * decay
        o = _dot(q * jnp.exp(cum)[:, None], s) + _dot(intra, v_new)
        o_ref[span, :] = o.astype(o_ref.dtype)
        k_to_end = k * jnp.exp(total - cum)[:, None]
        return s * jnp.exp(total) + _dot(k_to_end, v_new, (0, 0))

    num_chunks = q_ref.shape[0] // c
    state_out_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk_body, state_ref[...])


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk_size: int = CHUNK_SIZE,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q, k: [B, H, T, dk]; v: [B, H, T, dv]; g, beta: [B, H, T]; state: [B, H, dk, dv].

    Returns o: [B, H, T, dv] fp32 and the final state. T need not be a multiple of the chunk:
    the tail is padded with g = beta = 0, which leaves the state untouched.
    """
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or v.shape[:3] != (b, h, t) or g.shape != (b, h, t):
        raise ValueError(
            f"gated delta rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape} do not agree"
        )
    if beta.shape != g.shape or state.shape != (b, h, dk, dv):
        raise ValueError(
            f"gated delta rule: beta {beta.shape} or state {state.shape} "
            f"does not match q {q.shape} and v {v.shape}"
        )
    pad = (-t) % chunk_size
    f32 = jnp.float32
    q, k, v = (jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    tp = t + pad
    sq = pl.squeezed

    def seq(width: int) -> pl.BlockSpec:
        return pl.BlockSpec((sq, sq, tp, width), lambda bi, hi: (bi, hi, 0, 0))

    gate = pl.BlockSpec((sq, sq, tp), lambda bi, hi: (bi, hi, 0))
    state_spec = pl.BlockSpec((sq, sq, dk, dv), lambda bi, hi: (bi, hi, 0, 0))
    o, state = pl.pallas_call(
        functools.partial(_chunk_kernel, chunk=chunk_size),
        grid=(b, h),
        in_specs=[seq(dk), seq(dk), seq(dv), gate, gate, state_spec],
        out_specs=[seq(dv), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, tp, dv), f32),
            jax.ShapeDtypeStruct((b, h, dk, dv), f32),
        ],
        interpret=interpret,
        name="chunk_gated_delta_rule",
    )(q, k, v, g, beta, state.astype(f32))
    return o[:, :, :t], state


def _step_kernel(
    q_ref: Any,  # [dk]
    k_ref: Any,  # [dk]
    v_ref: Any,  # [dv]
    g_ref: Any,  # [1]
    beta_ref: Any,  # [1]
    state_ref: Any,  # [dk, dv]
    o_ref: Any,  # [dv]
    state_out_ref: Any,  # [dk, dv]
) -> None:
    s = state_ref[...] * jnp.exp(g_ref[...])[:, None]
    k = k_ref[...][:, None]
    delta = (v_ref[...] - jnp.sum(s * k, axis=0)) * beta_ref[...]
    s = s + k * delta[None, :]
    o_ref[...] = jnp.sum(s * q_ref[...][:, None], axis=0)
    state_out_ref[...] = s


def gated_delta_rule_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One decode token. q, k: [B, H, dk]; v: [B, H, dv]; g, beta: [B, H]; state: [B, H, dk, dv].

    Returns o: [B, H, dv] fp32 and the new state.
    """
    b, h, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or v.shape[:2] != (b, h) or g.shape != (b, h) or beta.shape != (b, h):
        raise ValueError(
            f"delta rule step: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
            f"beta {beta.shape} do not agree"
        )
    if state.shape != (b, h, dk, dv):
        raise ValueError(f"delta rule step: state {state.shape} is not {(b, h, dk, dv)}")
    f32 = jnp.float32
    sq = pl.squeezed

    def vec(width: int) -> pl.BlockSpec:
        return pl.BlockSpec((sq, sq, width), lambda bi, hi: (bi, hi, 0))

    state_spec = pl.BlockSpec((sq, sq, dk, dv), lambda bi, hi: (bi, hi, 0, 0))
    o, state = pl.pallas_call(
        _step_kernel,
        grid=(b, h),
        in_specs=[vec(dk), vec(dk), vec(dv), vec(1), vec(1), state_spec],
        out_specs=[vec(dv), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, dv), f32),
            jax.ShapeDtypeStruct((b, h, dk, dv), f32),
        ],
        interpret=interpret,
        name="gated_delta_rule_step",
    )(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        g.astype(f32)[..., None],
        beta.astype(f32)[..., None],
        state.astype(f32),
    )
    return o, state


def delta_rule_kernel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    valid: jax.Array,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernels behind the references' contract (raw layer inputs, prepared here): the
    one-step update for a single token, the chunked kernel otherwise."""
    q, k, v, g, beta = prepare(q, k, v, g, beta, valid)
    if q.shape[2] == 1:
        o, state = gated_delta_rule_step(
            q[:, :, 0],
            k[:, :, 0],
            v[:, :, 0],
            g[:, :, 0],
            beta[:, :, 0],
            state,
            interpret=interpret,
        )
        return o[:, None], state
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, state, interpret=interpret)
    return jnp.swapaxes(o, 1, 2), state
