"""Moving pooled state between the device and canonical host arrays, for the store.

Canonical shapes (the store's payload layout): a page is `[kv_layers, 2, page_size, kv_heads,
head_dim]`; a GDN state is recurrent `[gdn_layers, v_heads, dk, dv]` and conv
`[gdn_layers, kernel - 1, conv_dim]`. Reads gather from whatever placement the state has;
writes scatter into it in place (donated). Nothing here depends on the layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.cache import CacheState, GDNSlots, KVPages


@jax.jit
def _gather(pool: jax.Array, ids: jax.Array) -> jax.Array:
    return pool[ids]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(pool: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    return pool.at[ids].set(rows.astype(pool.dtype))


# One small program per pool leaf, not one over all layers: under a pipeline the layers live on
# different devices, and a program can only take arrays from one device set.


def read_pages(state: CacheState, pages: list[int]) -> np.ndarray:
    ids = jnp.asarray(pages, jnp.int32)
    per_layer = jax.device_get([(_gather(p.k, ids), _gather(p.v, ids)) for p in state.kv])
    # -> [n, layers, 2, page_size, kv_heads, head_dim]
    return np.stack([np.stack(kv, axis=1) for kv in per_layer], axis=1)


def read_slot(state: CacheState, slot: int) -> tuple[np.ndarray, np.ndarray]:
    i = jnp.asarray(slot, jnp.int32)
    rows = jax.device_get([(_gather(s.recurrent, i), _gather(s.conv, i)) for s in state.gdn])
    return np.stack([r for r, _ in rows]), np.stack([c for _, c in rows])


def write_pages(state: CacheState, pages: list[int], data: np.ndarray) -> CacheState:
    ids = np.asarray(pages, np.int32)
    kv = tuple(
        KVPages(_scatter(p.k, ids, data[:, i, 0]), _scatter(p.v, ids, data[:, i, 1]))
        for i, p in enumerate(state.kv)
    )
    return CacheState(kv=kv, gdn=state.gdn)


def write_slot(state: CacheState, slot: int, rec: np.ndarray, conv: np.ndarray) -> CacheState:
    i = np.asarray(slot, np.int32)
    gdn = tuple(
        GDNSlots(_scatter(s.recurrent, i, rec[n]), _scatter(s.conv, i, conv[n]))
        for n, s in enumerate(state.gdn)
    )
    return CacheState(kv=state.kv, gdn=gdn)
