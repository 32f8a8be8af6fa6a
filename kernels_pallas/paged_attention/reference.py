"""Paged attention in pure JAX: the reference every paged attention kernel is checked against,
and what the engine reads its KV pages through when the dispatch selects the references; with
it the unpaged causal attention by position. This module imports nothing from flipjax.

8-bit pages: `k_pages`/`v_pages` of int8 or float8_e4m3fn come with `k_scale`/`v_scale`,
float32 [pages, kv_heads], one scale per page per kv head; element [p, s, h, d] stands for
`float32(pages[p, s, h, d]) * scale[p, h]`. Every form dequantizes a block of gathered pages at
a time, so no dequantized copy of the pool ever exists.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.pages import SCALED_PAGE_DTYPES

MASKED = -1e30  # finite so an all-masked (padding) row gives a uniform softmax, not NaN


def check_scales(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
) -> None:
    """Raises ValueError unless each of k and v pages is 8-bit exactly when its scale is given,
    and each scale given is float32 [pages, kv_heads] of its pages. Every paged attention form
    calls this, so one format is refused the same way everywhere."""
    for name, pages, scale in (("k", k_pages, k_scale), ("v", v_pages, v_scale)):
        dtype = jnp.dtype(pages.dtype)
        if dtype in SCALED_PAGE_DTYPES and scale is None:
            raise ValueError(
                f"paged attention: {name} pages are {dtype} and need {name}_scale, "
                f"float32 [pages, kv_heads]"
            )
        if dtype not in SCALED_PAGE_DTYPES and scale is not None:
            raise ValueError(
                f"paged attention: {name}_scale given for {dtype} {name} pages; scales are "
                f"only for int8 or float8_e4m3fn pages"
            )
        want = (pages.shape[0], pages.shape[2])
        if scale is not None and (scale.shape != want or scale.dtype != jnp.float32):
            raise ValueError(
                f"paged attention: {name}_scale is {scale.dtype} {scale.shape}, want float32 "
                f"{want} (pages, kv_heads) for {name} pages {pages.shape}"
            )


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array
) -> jax.Array:
    """Causal GQA attention by position.

    q: [B, T, H, D]; k, v: [B, S, Hkv, D]; q_pos: [B, T]; k_pos: [B, S] (-1 = empty).
    Returns [B, T, H, D] in q's dtype; softmax in fp32.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) * (d**-0.5)
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    pages_per_block: int = 8,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    read: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """q: [B, T, H, D]; page_table: [B, max_pages]; positions: [B, T]. Returns [B, T, H, D].
    k_scale, v_scale: float32 [pages, kv_heads], required with 8-bit pages and refused with
    float ones (`check_scales`). `read(pool, ids)` gathers pages (default `pool[ids]`; the
    native mode's reads a bf16 or 8-bit pool without widening all of it).

    Attends each query to every cached position <= its own. The table is walked in blocks of
    `pages_per_block` pages with an online softmax, for as many blocks as the deepest query
    needs (a traced trip count): the table can be as wide as the longest request allowed while
    a step costs what the batch's actual lengths cost, and the width never forces a recompile.
    Table entries past a row's pages may hold anything; they are masked by position.
    """
    check_scales(k_pages, v_pages, k_scale, v_scale)
    b, t, h, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    g = h // hkv
    block = pages_per_block * page_size
    width = -(-page_table.shape[1] // pages_per_block) * pages_per_block
    page_table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))
    qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32) * (d**-0.5)
    num_blocks = (jnp.max(positions) + block) // block  # 0 when the whole batch is padding

    def gather(pool: jax.Array, scale: jax.Array | None, pages: jax.Array) -> jax.Array:
        x = pool[pages] if read is None else read(pool, pages)  # [B, block pages, S, Hkv, D]
        if scale is not None:
            x = x.astype(jnp.float32) * scale[pages][:, :, None, :, None]
        return x.reshape(b, block, hkv, d).astype(jnp.float32)

    def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, i * pages_per_block, pages_per_block, 1)
        k = gather(k_pages, k_scale, pages)
        v = gather(v_pages, v_scale, pages)
        k_pos = i * block + jnp.arange(block)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k)
        mask = k_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
        s = jnp.where(mask[:, None, None], s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        denom = denom * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, v)
        return m_new, denom, acc

    init = (
        jnp.full((b, hkv, g, t), MASKED, jnp.float32),
        jnp.zeros((b, hkv, g, t), jnp.float32),
        jnp.zeros((b, hkv, g, t, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # all-padding rows have denom == 0
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(q.dtype)
