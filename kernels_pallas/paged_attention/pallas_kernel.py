"""The Pallas kernel of paged attention: ragged rows of decode tokens and prefill chunks in one
call, each kv head's pages read once for its whole group of query heads, with optional split-K
for long contexts. `reference.paged_attention_reference` is its contract, 8-bit pages with
their scales included. This module imports nothing from flipjax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.paged_attention.reference import MASKED, check_scales

# A GPU has ~100+ SMs; split long contexts until there are about this many programs.
_TARGET_PROGRAMS = 128


def _ragged_kernel(
    q_ref: Any,  # [block_r, D]: query rows (token, head-in-group) of one kv head
    row_pos_ref: Any,  # [block_r]: each row's position, -1 = padding
    k_pages_ref: Any,  # [pages, page_size, D]: this kv head's pages
    v_pages_ref: Any,
    page_table_ref: Any,  # [max_pages]
    *refs: Any,  # [k_scale_ref], [v_scale_ref] ([pages] of this kv head), o_ref, l_ref, m_ref
    pages_per_block: int,
    blocks_per_split: int,
    scale: float,
    k_scaled: bool,
    v_scaled: bool,
) -> None:
    # The scale refs exist only for 8-bit pages, so float pages compile the kernel they always did.
    *scale_refs, o_ref, l_ref, m_ref = refs  # o [block_r, D]; l, m [block_r]: this split's stats
    scale_refs = iter(scale_refs)
    k_scale_ref = next(scale_refs) if k_scaled else None
    v_scale_ref = next(scale_refs) if v_scaled else None
    split = pl.program_id(3)
    page_size, head_dim = k_pages_ref.shape[1:]
    block_k = pages_per_block * page_size
    q = q_ref[...]
    pos = row_pos_ref[...]
    # Walk only the blocks the deepest row of this tile needs; 0 when it is all padding.
    needed = (jnp.max(pos) + block_k) // block_k
    start = split * blocks_per_split
    stop = jnp.minimum(needed, start + blocks_per_split)

    def gather(pages_ref: Any, scale_ref: Any, pages: jax.Array) -> jax.Array:
        x = pages_ref[pages]  # [pages_per_block, page_size, D]
        if scale_ref is not None:
            # Dequantized one block at a time, in fp32: only this block ever exists widened.
            x = x.astype(jnp.float32) * scale_ref[pages][:, None, None]
        return x.reshape(block_k, head_dim)

    def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        acc, m, denom = carry
        pages = page_table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = gather(k_pages_ref, k_scale_ref, pages)
        v = gather(v_pages_ref, v_scale_ref, pages)
        qk = q.astype(k.dtype) if k_scaled else q
        s = (
            jax.lax.dot_general(qk, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * scale
        )
        k_pos = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        mask = k_pos <= pos[:, None]
        s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # Masked keys contribute exactly 0, so an all-padding row ends with denom == 0.
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        denom = denom * correction + jnp.sum(p, axis=1)
        # A dequantized v is fp32, so p stays fp32 (never cast to the 8-bit page dtype).
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, m_new, denom

    rows = q.shape[0]
    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, denom = jax.lax.fori_loop(start, stop, body, init)
    o_ref[...] = acc
    l_ref[...] = denom
    m_ref[...] = m


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    block_rows: int = 16,
    pages_per_block: int = 8,
    kv_splits: int = 1,
    interpret: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """The Pallas kernel behind `paged_attention_reference`; same arguments, same result.

    Each program takes one row of the batch, one kv head and a tile of `block_rows` query rows,
    where a query row is one (token, query head of the group) pair: a decode row's group of
    heads and a prefill chunk's tokens share one code path and the kv head's pages are read
    once for the whole group. Pages are gathered through the page table in blocks of
    `pages_per_block` and reduced with an online softmax. `kv_splits > 1` also splits the
    context across programs (split-K) and merges the partial softmaxes here, which keeps a
    GPU busy when batch x kv heads is small and contexts are long. 8-bit pages take
    `k_scale`/`v_scale` float32 [pages, kv_heads] (`reference.check_scales`); each program reads
    its kv head's column and dequantizes each gathered block in fp32.
    """
    b, t, h, d = q.shape
    num_pages, page_size, hkv, d_k = k_pages.shape
    if d_k != d or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"paged attention: q head_dim {d}, k pages {k_pages.shape}, "
            f"v pages {v_pages.shape} do not agree"
        )
    if h % hkv:
        raise ValueError(f"paged attention: {h} query heads do not group over {hkv} kv heads")
    if positions.shape != (b, t) or page_table.shape[0] != b:
        raise ValueError(
            f"paged attention: positions {positions.shape} and page table "
            f"{page_table.shape} do not match q {q.shape}"
        )
    if block_rows < 1 or pages_per_block < 1 or kv_splits < 1:
        raise ValueError("paged attention: block_rows, pages_per_block and kv_splits must be >= 1")
    check_scales(k_pages, v_pages, k_scale, v_scale)
    g = h // hkv
    rows = t * g
    rows_padded = -(-rows // block_rows) * block_rows
    q_rows = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    row_pos = jnp.repeat(positions.astype(jnp.int32), g, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows_padded - rows)), constant_values=-1)
    num_blocks = -(-page_table.shape[1] // pages_per_block)
    blocks_per_split = -(-num_blocks // kv_splits)
    width = blocks_per_split * kv_splits * pages_per_block
    # Entries past a row's pages may hold anything; clip so every gather stays in bounds.
    table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))

    sq = pl.squeezed
    grid = (b, hkv, rows_padded // block_rows, kv_splits)
    row_tile = pl.BlockSpec((sq, sq, block_rows, d), lambda bi, hi, ri, si: (bi, hi, ri, 0))
    pages_spec = pl.BlockSpec((num_pages, page_size, sq, d), lambda bi, hi, ri, si: (0, 0, hi, 0))
    stat_spec = pl.BlockSpec((sq, sq, sq, block_rows), lambda bi, hi, ri, si: (si, bi, hi, ri))
    scale_spec = pl.BlockSpec((num_pages, sq), lambda bi, hi, ri, si: (0, hi))
    scales = [s for s in (k_scale, v_scale) if s is not None]
    kernel = functools.partial(
        _ragged_kernel,
        pages_per_block=pages_per_block,
        blocks_per_split=blocks_per_split,
        scale=d**-0.5,
        k_scaled=k_scale is not None,
        v_scaled=v_scale is not None,
    )
    stats_shape = jax.ShapeDtypeStruct((kv_splits, b, hkv, rows_padded), jnp.float32)
    acc, denom, m = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            row_tile,
            pl.BlockSpec((sq, block_rows), lambda bi, hi, ri, si: (bi, ri)),
            pages_spec,
            pages_spec,
            pl.BlockSpec((sq, width), lambda bi, hi, ri, si: (bi, 0)),
            *[scale_spec] * len(scales),
        ],
        out_specs=[
            pl.BlockSpec((sq, sq, sq, block_rows, d), lambda bi, hi, ri, si: (si, bi, hi, ri, 0)),
            stat_spec,
            stat_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((kv_splits, b, hkv, rows_padded, d), jnp.float32),
            stats_shape,
            stats_shape,
        ],
        interpret=interpret,
        name="ragged_paged_attention",
    )(q_rows, row_pos, k_pages, v_pages, table, *scales)
    # Merge the splits' partial softmaxes (a no-op rescale when kv_splits == 1).
    m_all = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_all[None])
    denom = jnp.sum(denom * weight, axis=0)
    out = jnp.sum(acc * weight[..., None], axis=0) / jnp.maximum(denom, 1e-30)[..., None]
    out = out[:, :, :rows].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)


def tuned_paged_attention(
    q_shape: tuple[int, ...], kv_heads: int, table_width: int, mode: str
) -> Callable[..., jax.Array]:
    """`ragged_paged_attention` with its tiles chosen for q [B, T, H, D] over `kv_heads`
    heads and a page table `table_width` wide; `mode` "interpret" runs it on the CPU."""
    b, t, h, _ = q_shape
    rows = t * (h // kv_heads)
    block_rows = 16 if rows <= 16 else 64
    pages_per_block = 8
    num_blocks = -(-table_width // pages_per_block)
    tiles = b * kv_heads * -(-rows // block_rows)
    splits = 1 if mode == "interpret" else max(1, min(num_blocks, _TARGET_PROGRAMS // tiles))
    return functools.partial(
        ragged_paged_attention,
        block_rows=block_rows,
        pages_per_block=pages_per_block,
        kv_splits=splits,
        interpret=mode == "interpret",
    )
