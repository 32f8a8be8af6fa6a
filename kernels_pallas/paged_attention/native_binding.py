"""Decode attention over paged K/V by the native CPU kernel (`paged_decode.cc` beside this file).

XLA's form of the reference walks the page table in a loop of gathers, transposes and small
dots; the kernel reads each row's keys and values once per KV head. It computes the reference's
softmax in one pass instead of block by block, so results agree to rounding. Pages may be 8-bit
(int8 or float8_e4m3fn) with a float32 scale per page and KV head, dequantized in the kernel as
it reads them. This module imports nothing from flipjax.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas import native
from kernels_pallas.paged_attention.reference import check_scales

# The kernel of each page dtype it takes (`dtype in HANDLERS` asks whether it takes pages).
HANDLERS = {
    jnp.dtype(jnp.float32): "paged_decode",
    jnp.dtype(jnp.bfloat16): "paged_decode_bf16",
    jnp.dtype(jnp.int8): "paged_decode_int8",
    jnp.dtype(jnp.float8_e4m3fn): "paged_decode_fp8",
}


def decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    isa: str | None = None,
) -> jax.Array:
    """q [B, 1, H, D] attends to each row's cached positions 0..positions[:, 0] in k/v pages
    [P, page_size, Hkv, D] through page_table [B, W]; [B, 1, H, D] in q's dtype. A row at
    position -1 is padding (its output is zero). Pages are float32 or bfloat16 (no scales), or
    int8 or float8_e4m3fn with k_scale and v_scale float32 [P, Hkv], both required: element
    [p, s, h, d] is worth pages[p, s, h, d] * scale[p, h]. The kernel is the one built for `isa`
    (see `native.ISAS`; default `native.build_isa()`)."""
    b, t, h, d = q.shape
    if t != 1 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"paged decode: need q [B, 1, H, D] and k/v pages of one shape [P, S, Hkv, D], got "
            f"{q.shape}, {k_pages.shape} and {v_pages.shape}"
        )
    dtype = jnp.dtype(k_pages.dtype)
    if dtype not in HANDLERS or v_pages.dtype != dtype:
        raise ValueError(
            f"paged decode: K and V pages must be one of {sorted(map(str, HANDLERS))}, got "
            f"{k_pages.dtype} and {v_pages.dtype}"
        )
    check_scales(k_pages, v_pages, k_scale, v_scale)
    scales = () if k_scale is None else (k_scale, v_scale)
    out = jax.ffi.ffi_call(
        native.target(HANDLERS[dtype], isa), jax.ShapeDtypeStruct((b, h, d), jnp.float32)
    )(
        q[:, 0].astype(jnp.float32),
        k_pages,
        v_pages,
        *scales,
        page_table.astype(jnp.int32),
        positions[:, 0].astype(jnp.int32),
    )
    return out[:, None].astype(q.dtype)


def per_position(
    kernel: Callable[..., jax.Array],
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    **scales: jax.Array | None,
) -> jax.Array:
    """Attention of q [B, T, H, D] as B * T one-token rows, each over its row's pages up to its
    own position: causal within the row, since its new K/V are written before it attends. The
    keys are read once per position, which pays for a verify step's few (not a prefill's)."""
    b, t = q.shape[:2]
    out = kernel(
        q.reshape(b * t, 1, *q.shape[2:]),
        k_pages,
        v_pages,
        jnp.repeat(page_table, t, axis=0),
        positions.reshape(b * t, 1),
        **scales,
    )
    return out.reshape(b, t, *out.shape[2:])
