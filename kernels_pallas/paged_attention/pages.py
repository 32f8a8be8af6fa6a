"""Writing a step's new K/V into the pages its rows' page tables name (the layout is in the
package docstring), in the pages' dtype. This module imports nothing from flipjax.

8-bit pages (int8, float8_e4m3fn) keep a float32 scale per page and KV head, `[pages,
kv_heads]`: a stored value is the page's element times its scale. A page's scale is its
tokens' largest magnitude over the 8-bit format's largest value, so a page's scale does not
depend on how its tokens were split into steps. Tokens arrive a step at a time, so a write
that raises a page's scale first re-rounds what the page already holds to the new scale. Only
a row's first page in a step can hold earlier tokens (every later one starts in the step), so
that is the one page per row re-rounded. A write at a page's first slot starts it afresh:
the scale a recycled page had is its previous owner's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# (pool [*lead, *row], rows [N, *row], ids [N]) -> pool with row n at ids[n] of the pool's
# prod(lead) rows; an id outside them is dropped.
Writer = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def scatter_rows(pool: jax.Array, rows: jax.Array, ids: jax.Array) -> jax.Array:
    """XLA's scatter; ids index the pool's leading dims before the rows' shape, flattened."""
    flat = pool.reshape(-1, *rows.shape[1:])
    return flat.at[ids].set(rows.astype(pool.dtype), mode="drop").reshape(pool.shape)


# The 8-bit page dtypes and the largest magnitude each holds.
SCALED_PAGE_DTYPES = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x / scale in the 8-bit `dtype` (rounded to nearest, clipped to its range); a zero scale
    (a page of zeros) stores zeros."""
    top = SCALED_PAGE_DTYPES[jnp.dtype(dtype)]
    scaled = jnp.where(scale > 0, x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0), 0.0)
    scaled = jnp.clip(scaled, -top, top)
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return scaled.astype(dtype)


def write_pages(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    writer: Writer = scatter_rows,
) -> tuple[jax.Array, ...]:
    """Scatter new K/V ([B, T, Hkv, D]) into their pages; padding tokens are dropped.

    Float pages: returns (k_pages, v_pages). 8-bit pages take and return their scales too:
    (k_pages, v_pages, k_scale, v_scale). `writer(pool, rows, ids)` puts rows into a pool
    (`kernels_pallas.dispatch.page_writer`: in place where the native kernel runs)."""
    num_pages, page_size = k_pages.shape[:2]
    safe_pos = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(page_table, safe_pos // page_size, axis=1)
    page = jnp.where(positions >= 0, page, num_pages)  # out of bounds -> dropped
    offset = safe_pos % page_size
    scaled = jnp.dtype(k_pages.dtype) in SCALED_PAGE_DTYPES
    if {k_scale is None, v_scale is None} != {not scaled} or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"write_pages: {k_pages.dtype} pages need scales exactly when they are 8-bit "
            f"({sorted(map(str, SCALED_PAGE_DTYPES))})"
        )
    if k_scale is None:
        k_pages = _write_tokens(k_pages, page, offset, k, writer)
        v_pages = _write_tokens(v_pages, page, offset, v, writer)
        return k_pages, v_pages
    k_pages, k_scale = _write_scaled(k_pages, k_scale, k, page, offset, positions, writer)
    v_pages, v_scale = _write_scaled(v_pages, v_scale, v, page, offset, positions, writer)
    return k_pages, v_pages, k_scale, v_scale


def _write_scaled(
    pages: jax.Array,
    scale: jax.Array,
    x: jax.Array,
    page: jax.Array,
    offset: jax.Array,
    positions: jax.Array,
    writer: Writer,
) -> tuple[jax.Array, jax.Array]:
    num_pages, heads = scale.shape
    top = SCALED_PAGE_DTYPES[jnp.dtype(pages.dtype)]
    flat_page = page.reshape(-1)
    need = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1).reshape(-1, heads) / top
    start_page = jnp.where(offset == 0, page, num_pages).reshape(-1)
    starts = jnp.zeros((num_pages,), bool).at[start_page].set(True, mode="drop")
    touched = jnp.zeros((num_pages,), bool).at[flat_page].set(True, mode="drop")
    kept = jnp.where(starts[:, None], 0.0, scale)
    grown = jnp.zeros_like(scale).at[flat_page].max(need, mode="drop")
    new_scale = jnp.where(touched[:, None], jnp.maximum(kept, grown), scale)
    # Each row's first page, where it continues earlier tokens: re-rounded to the new scale.
    first = jnp.where((positions[:, 0] >= 0) & (offset[:, 0] > 0), page[:, 0], num_pages)
    held = jnp.take(pages, first, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    old = jnp.take(kept, first, axis=0, mode="fill", fill_value=0)[:, None, :, None]
    new = jnp.take(new_scale, first, axis=0, mode="fill", fill_value=1)[:, None, :, None]
    pages = writer(pages, quantize(held * old, new, pages.dtype), first)
    token_scale = jnp.take(new_scale, page, axis=0, mode="fill", fill_value=1)[..., None]
    pages = _write_tokens(pages, page, offset, quantize(x, token_scale, pages.dtype), writer)
    return pages, new_scale


def _write_tokens(
    pages: jax.Array, page: jax.Array, offset: jax.Array, x: jax.Array, writer: Writer
) -> jax.Array:
    """Token rows x [B, T, Hkv, D] into pages [P, S, Hkv, D] at (page, offset), as slot ids
    into the pool's P * S token rows; a page id of P or more is dropped (so is every slot id it
    makes)."""
    num_pages, page_size, heads, dim = pages.shape
    ids = (page * page_size + offset).reshape(-1)
    return writer(pages, x.reshape(-1, heads, dim).astype(pages.dtype), ids)
