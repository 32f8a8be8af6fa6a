"""Moving pooled state between the device and canonical host arrays, for the store.

Canonical shapes (the store's payload layout): a page is `[kv_layers, 2, page_size, kv_heads,
head_dim]`; a GDN state is recurrent `[gdn_layers, v_heads, dk, dv]` and conv
`[gdn_layers, kernel - 1, conv_dim]`. Reads gather from whatever placement the state has;
writes scatter into it in place (donated). Nothing here depends on the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.cache import CacheState, GDNSlots, KVPages


@jax.jit
def _gather_pages(kv: tuple[KVPages, ...], pages: jax.Array) -> jax.Array:
    # -> [n, layers, 2, page_size, kv_heads, head_dim]
    return jnp.stack([jnp.stack([p.k[pages], p.v[pages]], axis=1) for p in kv], axis=1)


@jax.jit
def _gather_slot(gdn: tuple[GDNSlots, ...], slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    return (
        jnp.stack([s.recurrent[slot] for s in gdn]),
        jnp.stack([s.conv[slot] for s in gdn]),
    )


@jax.jit
def _scatter_pages(kv: tuple[KVPages, ...], pages: jax.Array, data: jax.Array):
    return tuple(
        KVPages(
            p.k.at[pages].set(data[:, i, 0].astype(p.k.dtype)),
            p.v.at[pages].set(data[:, i, 1].astype(p.v.dtype)),
        )
        for i, p in enumerate(kv)
    )


@jax.jit
def _scatter_slot(gdn: tuple[GDNSlots, ...], slot: jax.Array, rec: jax.Array, conv: jax.Array):
    return tuple(
        GDNSlots(
            s.recurrent.at[slot].set(rec[i].astype(s.recurrent.dtype)),
            s.conv.at[slot].set(conv[i].astype(s.conv.dtype)),
        )
        for i, s in enumerate(gdn)
    )


def read_pages(state: CacheState, pages: list[int]) -> np.ndarray:
    return np.asarray(jax.device_get(_gather_pages(state.kv, jnp.asarray(pages, jnp.int32))))


def read_slot(state: CacheState, slot: int) -> tuple[np.ndarray, np.ndarray]:
    rec, conv = jax.device_get(_gather_slot(state.gdn, jnp.asarray(slot, jnp.int32)))
    return np.asarray(rec), np.asarray(conv)


def write_pages(state: CacheState, pages: list[int], data: np.ndarray) -> CacheState:
    kv = _scatter_pages(state.kv, jnp.asarray(pages, jnp.int32), jnp.asarray(data))
    return CacheState(kv=kv, gdn=state.gdn)


def write_slot(state: CacheState, slot: int, rec: np.ndarray, conv: np.ndarray) -> CacheState:
    gdn = _scatter_slot(
        state.gdn, jnp.asarray(slot, jnp.int32), jnp.asarray(rec), jnp.asarray(conv)
    )
    return CacheState(kv=state.kv, gdn=gdn)
