"""Writing a step's new K/V into the pages its rows' page tables name (the layout is in the
package docstring). This module imports nothing from flipjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_pages(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V ([B, T, Hkv, D]) into their pages; padding tokens are dropped."""
    num_pages, page_size = k_pages.shape[:2]
    safe_pos = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(page_table, safe_pos // page_size, axis=1)
    page = jnp.where(positions >= 0, page, num_pages)  # out of bounds -> dropped
    offset = safe_pos % page_size
    k_pages = k_pages.at[page, offset].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, offset].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
