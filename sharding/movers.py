"""Moving the live part of the pooled state to another placement, device to device: a
cluster's flip (in one process a flip passes through the host, `sharding.windowed_flip`).

A flip moves the parameters whole, but of each KV page pool and GDN slot pool only the rows
someone holds (a request, the device prefix cache): they are gathered on the source devices,
copied device to device, and scattered into a pool the target allocates itself (zeros, never
copied). Ids stay what they are, so nothing is renumbered and the scheduler's tables keep their
meaning; a flip's cost grows with occupancy, not with the pool.

Row counts are rounded up to a power of four, so a handful of programs serve every occupancy;
when that reaches the pool, the pool is copied whole instead. `warm` compiles them all for a
pair of placements. What remains of the pool's size in a flip's cost is the target zero-filling
its new pool, which is a memset, not a copy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from flipjax.runtime.cache import CacheState, GDNSlots
from flipjax.runtime.crosshost import from_host, reshard


def bucket(n: int, total: int) -> int:
    """Rows moved for `n` live rows of a `total`-row pool: a power of four, or the pool."""
    size = 1
    while size < min(n, total):
        size = min(size * 4, total)
    return size


def buckets(total: int) -> list[int]:
    out = [bucket(0, total)]
    while out[-1] < total:
        out.append(bucket(out[-1] + 1, total))
    return out


@jax.jit
def _gather(pool: jax.Array, ids: jax.Array) -> jax.Array:
    return pool[ids]


@functools.cache
def _filler(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> Any:
    """A program that builds a pool of `shape` on `sharding` holding `rows` at `ids` and zeros
    elsewhere (ids out of range are padding, dropped)."""

    def fill(rows: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.zeros(shape, dtype).at[ids].set(rows.astype(dtype), mode="drop")

    return jax.jit(fill, out_shardings=sharding)


def _move_leaf(leaf: jax.Array, target: NamedSharding, live: Sequence[int]) -> jax.Array:
    total = leaf.shape[0]
    size = bucket(len(live), total)
    if size == total:  # the live set is the pool (or most of it): one plain copy is cheaper
        return reshard(leaf, target)
    take = np.zeros(size, np.int32)  # gather pads with a valid row, sliced off by the scatter
    put = np.full(size, total, np.int32)  # scatter pads with an out-of-range id, dropped
    take[: len(live)] = put[: len(live)] = live
    rows = _gather(leaf, from_host(take, _replicated(leaf.sharding)))
    rows = reshard(rows, target)
    return _filler(leaf.shape, leaf.dtype, target)(rows, from_host(put, _replicated(target)))


def _replicated(sharding: Any) -> Any:
    return NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())


def move_live(
    state: CacheState, shardings: CacheState, pages: Sequence[int], slots: Sequence[int]
) -> tuple[CacheState, dict[str, float]]:
    """`state` on `shardings` with only `pages` and `slots` copied; bytes and ms per part."""
    t0 = time.perf_counter()
    kv = jax.tree.map(lambda x, s: _move_leaf(x, s, pages), state.kv, shardings.kv)
    jax.block_until_ready(kv)
    t1 = time.perf_counter()
    gdn = tuple(
        GDNSlots(*(_move_leaf(x, s, slots) for x, s in zip(g, sh, strict=True)))
        for g, sh in zip(state.gdn, shardings.gdn, strict=True)
    )
    jax.block_until_ready(gdn)
    t2 = time.perf_counter()
    num_pages = state.kv[0].k.shape[0] if state.kv else 1
    num_slots = state.gdn[0].recurrent.shape[0] if state.gdn else 1
    moved = {  # what crossed: the live rows rounded up to their bucket
        "kv_bytes": _row_bytes(state.kv) * bucket(len(pages), num_pages),
        "gdn_bytes": _row_bytes(state.gdn) * bucket(len(slots), num_slots),
        "kv_ms": (t1 - t0) * 1e3,
        "gdn_ms": (t2 - t1) * 1e3,
    }
    return CacheState(kv=kv, gdn=gdn), moved


def _row_bytes(pools: Any) -> int:
    """Bytes of one row (page or slot) across every layer of `pools`."""
    return sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(pools))


def warm(state: CacheState, source: CacheState, target: CacheState) -> None:
    """Compile every program a live move between the two placements uses, both ways: each
    bucket of pages and of slots, moved there and back from the live state (results dropped)."""
    num_pages = state.kv[0].k.shape[0] if state.kv else 1
    num_slots = state.gdn[0].recurrent.shape[0] if state.gdn else 1
    trials = [(range(p), range(0)) for p in buckets(num_pages)]
    trials += [(range(0), range(s)) for s in buckets(num_slots)[1:]]
    for pages, slots in trials:
        there, _ = move_live(state, target, pages, slots)
        jax.block_until_ready(move_live(there, source, pages, slots)[0])
