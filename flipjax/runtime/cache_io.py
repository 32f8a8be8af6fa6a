"""Moving pooled state between the device and canonical host arrays, for the store.

Canonical shapes (the store's payload layout): a page is `[kv_layers, 2, page_size, kv_heads,
head_dim]`, with its scales `[kv_layers, 2, kv_heads]` when 8-bit (`HostPages`); a GDN state is
recurrent `[gdn_layers, v_heads, dk, dv]` and conv
`[gdn_layers, kernel - 1, conv_dim]`. Reads gather from whatever placement the state has;
writes scatter into it in place (donated). Nothing here depends on the layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.runtime.buckets import pow2_bucket, pow2_range
from flipjax.runtime.cache import CacheState, GDNSlots, KVPages, kv_scaled
from flipjax.runtime.crosshost import to_host
from flipjax.runtime.host_pages import HostPages


@jax.jit
def _gather(pool: jax.Array, ids: jax.Array) -> jax.Array:
    return pool[ids]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(pool: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    return pool.at[ids].set(rows.astype(pool.dtype), mode="drop")


def _bucketed(ids: list[int], pad_id: int) -> np.ndarray:
    """`ids` padded to a power of two, so the number of pages moved never forces a compile:
    one program per bucket, not one per prefix length. Gathers pad with a valid id (its rows
    are sliced off); scatters pad with an out-of-range id (its writes are dropped)."""
    return np.asarray(ids + [pad_id] * (pow2_bucket(len(ids)) - len(ids)), np.int32)


def _pad_rows(rows: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([rows, np.zeros((n - len(rows), *rows.shape[1:]), rows.dtype)])


# One small program per pool leaf, not one over all layers: under a pipeline the layers live on
# different devices, and a program can only take arrays from one device set.


def read_pages(state: CacheState, pages: list[int]) -> HostPages:
    ids = _bucketed(pages, 0)
    per_layer = to_host([[_gather(x, ids) for x in jax.tree.leaves(p)] for p in state.kv])
    n = len(pages)
    # -> [n, layers, 2, page_size, kv_heads, head_dim]; scales [n, layers, 2, kv_heads]
    values = np.stack([np.stack(kv[:2], axis=1) for kv in per_layer], axis=1)[:n]
    if not kv_scaled(state):
        return HostPages(values)
    scales = np.stack([np.stack(kv[2:], axis=1) for kv in per_layer], axis=1)[:n]
    return HostPages(values, scales)


def read_slot(state: CacheState, slot: int) -> tuple[np.ndarray, np.ndarray]:
    i = jnp.asarray(slot, jnp.int32)
    rows = to_host([(_gather(s.recurrent, i), _gather(s.conv, i)) for s in state.gdn])
    return np.stack([r for r, _ in rows]), np.stack([c for _, c in rows])


def write_pages(state: CacheState, pages: list[int], data: HostPages) -> CacheState:
    if (data.scales is not None) != kv_scaled(state):
        raise ValueError("write_pages: 8-bit pages need their scales, and float pages have none")
    num_pages = state.kv[0].k.shape[0] if state.kv else 0
    ids = _bucketed(pages, num_pages)
    values = _pad_rows(np.asarray(data.values), len(ids))
    scales = None if data.scales is None else _pad_rows(np.asarray(data.scales), len(ids))

    def layer(i: int, p: KVPages) -> KVPages:
        pages = (_scatter(p.k, ids, values[:, i, 0]), _scatter(p.v, ids, values[:, i, 1]))
        if scales is None:
            return KVPages(*pages)
        return KVPages(
            *pages,
            _scatter(p.k_scale, ids, scales[:, i, 0]),
            _scatter(p.v_scale, ids, scales[:, i, 1]),
        )

    return CacheState(kv=tuple(layer(i, p) for i, p in enumerate(state.kv)), gdn=state.gdn)


def write_slot(state: CacheState, slot: int, rec: np.ndarray, conv: np.ndarray) -> CacheState:
    i = np.asarray(slot, np.int32)
    gdn = tuple(
        GDNSlots(_scatter(s.recurrent, i, rec[n]), _scatter(s.conv, i, conv[n]))
        for n, s in enumerate(state.gdn)
    )
    return CacheState(kv=state.kv, gdn=gdn)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_row(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pool.at[dst].set(pool[src], mode="drop")


def copy_slot(state: CacheState, src: int, dst: int) -> CacheState:
    """Copy GDN slot `src` into slot `dst` on the device (the prefix cache's states)."""
    i, j = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    gdn = tuple(GDNSlots(_copy_row(s.recurrent, i, j), _copy_row(s.conv, i, j)) for s in state.gdn)
    return CacheState(kv=state.kv, gdn=gdn)


def copy_page(state: CacheState, src: int, dst: int) -> CacheState:
    """Copy KV page `src` into page `dst` on the device, in every layer (a forked choice's own
    copy of its parent's last, partly filled page)."""
    i, j = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    kv = jax.tree.map(lambda x: _copy_row(x, i, j), state.kv)
    return CacheState(kv=kv, gdn=state.gdn)


def warm(state: CacheState, max_pages: int) -> CacheState:
    """Compile every read, write and copy program the prefix cache and the store can use,
    changing nothing: reads are discarded and writes only target the dropped out-of-range id."""
    n = 1
    while True:
        read_pages(state, [0] * n)
        if state.kv:
            state = write_pages(state, [state.kv[0].k.shape[0]] * n, _empty_pages(state, n))
        if n >= max_pages:
            break
        n *= 2
    rec, conv = read_slot(state, 0)
    num_slots = state.gdn[0].recurrent.shape[0] if state.gdn else 0
    state = copy_slot(state, 0, num_slots)
    num_pages = state.kv[0].k.shape[0] if state.kv else 0
    state = copy_page(state, 0, num_pages)
    return write_slot(state, num_slots, rec, conv)


def warm_shapes(state: CacheState, shardings: CacheState, max_pages: int) -> None:
    """`warm`'s programs for pools shaped like `state`'s and laid out by `shardings`, compiled
    from shapes: nothing is allocated (a windowed flip's target has no pool until it lands)."""
    ids = [jax.ShapeDtypeStruct((n,), jnp.int32) for n in pow2_range(1, max_pages)]
    one = jax.ShapeDtypeStruct((), jnp.int32)
    for leaf, sharding in zip(
        jax.tree.leaves(state.kv), jax.tree.leaves(shardings.kv), strict=True
    ):
        pool = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        for n in ids:
            _gather.lower(pool, n).compile()
            rows = jax.ShapeDtypeStruct((n.shape[0], *leaf.shape[1:]), leaf.dtype)
            _scatter.lower(pool, n, rows).compile()
        _copy_row.lower(pool, one, one).compile()
    for leaf, sharding in zip(
        jax.tree.leaves(state.gdn), jax.tree.leaves(shardings.gdn), strict=True
    ):
        pool = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        _gather.lower(pool, one).compile()
        _scatter.lower(pool, one, jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)).compile()
        _copy_row.lower(pool, one, one).compile()


def _empty_pages(state: CacheState, n: int) -> HostPages:
    kv = state.kv[0]
    values = np.zeros((n, len(state.kv), 2, *kv.k.shape[1:]), kv.k.dtype)
    if not kv_scaled(state):
        return HostPages(values)
    return HostPages(values, np.zeros((n, len(state.kv), 2, kv.k.shape[2]), np.float32))
