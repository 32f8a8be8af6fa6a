"""Gated DeltaNet math in pure JAX: causal conv, the recurrent and the chunkwise delta rule.

These functions are the reference every GDN kernel is checked against, and the path the model
takes when the kernel dispatch selects the references (`prefill_rule` asks it). They carry
state explicitly (conv state and recurrent state in, final ones out) so that prefill, chunked
prefill and decode continue one another exactly.

Padding convention: `valid[b, t]` marks real tokens and is a right-padded prefix per row. A padded
token has beta = 0 and g = 0, so it neither decays nor writes the state, and the conv state keeps
the last real inputs. Never drop the fp32 casts: the state recurrence is unstable in bf16.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import dispatch
from kernels_pallas.gdn import chunk_gated_delta_rule, gated_delta_rule_step

CHUNK_SIZE = 64
_HI = jax.lax.Precision.HIGHEST
PREFILL_FORM_ENV = "FLIPJAX_GDN_PREFILL"


class GDNState(NamedTuple):
    """Per-request GDN layer state.

    recurrent: [B, Hv, dk, dv] float32, the delta-rule memory S.
    conv: [B, K-1, conv_dim], the last K-1 conv inputs (time-major).
    """

    recurrent: jax.Array
    conv: jax.Array


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(
    x: jax.Array, weight: jax.Array, conv_state: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d then SiLU.

    x: [B, T, C]; weight: [C, K]; conv_state: [B, K-1, C]; valid: [B, T] bool.
    Returns y: [B, T, C] and the new conv state (the last K-1 valid inputs).
    """
    kernel = weight.shape[-1]
    t = x.shape[1]
    xx = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight.astype(x.dtype)
    y = sum(xx[:, j : j + t, :] * w[:, j] for j in range(kernel))
    lengths = jnp.sum(valid.astype(jnp.int32), axis=1)
    idx = lengths[:, None] + jnp.arange(kernel - 1)[None, :]
    new_state = jnp.take_along_axis(xx, idx[:, :, None], axis=1)
    return jax.nn.silu(y), new_state.astype(conv_state.dtype)


def _prepare(
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
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)

    def body(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        o, s = delta_rule_step(*xs, s)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(body, state.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1), state  # [B, T, H, dv]


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
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)
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
    solved = jax.lax.linalg.triangular_solve(
        ut, rhs, left_side=True, lower=True, unit_diagonal=True
    )
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
    """The Pallas kernels behind the same contract: the one-step update for a single token,
    the chunked kernel otherwise."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)
    if q.shape[2] == 1:
        o, state = gated_delta_rule_step(
            q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], state,
            interpret=interpret,
        )
        return o[:, None], state
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, state, interpret=interpret)
    return jnp.swapaxes(o, 1, 2), state


def prefill_rule(num_tokens: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The delta-rule implementation for a call over `num_tokens` tokens.

    When the kernel dispatch selects Pallas (or interpret mode), the kernels run. Otherwise,
    decode (one token) is the recurrence; for prefill the chunked form suits matrix units, and
    on the CPU XLA runs the scan about twice as fast (measured at 128 and 1024 tokens), so it
    is the default there. `FLIPJAX_GDN_PREFILL=chunked|recurrent` overrides the reference form.
    """
    mode = dispatch.current_mode()
    if mode != "reference":
        return functools.partial(delta_rule_kernel, interpret=mode == "interpret")
    if num_tokens == 1:
        return delta_rule_recurrent
    form = os.environ.get(PREFILL_FORM_ENV) or (
        "recurrent" if jax.default_backend() == "cpu" else "chunked"
    )
    if form not in ("chunked", "recurrent"):
        raise ValueError(f"{PREFILL_FORM_ENV}: {form!r} is neither 'chunked' nor 'recurrent'")
    return delta_rule_chunked if form == "chunked" else delta_rule_recurrent
