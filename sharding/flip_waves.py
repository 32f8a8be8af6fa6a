"""A flip within a window: the state passes through the host, so no device holds two layouts.

1. **Pull.** The live rows of every pool (the pages and slots someone holds) are read to the
   host, a chunk at a time: a chunk's gathered rows take at most the window on any device.
2. **Free.** The old layout's weights and pools are deleted; the weights are in the engine's
   host image (`flipjax.runtime.host_image`), the live rows are on the host.
3. **Land.** The weights are written from the image in waves of at most the window on any
   device. Each pool is made as zeros on its own devices and its live rows are scattered in, a
   chunk at a time, by a program that donates the pool, so it is written in place.

A device's live bytes therefore never pass the larger of the old and the new layout's
footprint plus the window (`--flip-window`). A failure in the pull leaves the old layout
untouched. A failure once the old arrays are freed deletes what landed and lands the old
layout again from the same host copies, so the flip ends in the old layout with every live row
where it was. Every program is compiled from shapes when the layout is armed (`compile_all`);
nothing is allocated to arm it.

Waves report to `on_wave(label, temp)` (each device's temporary bytes of the wave's program):
the bench and the tests read live bytes there, and a test raises there to inject a failure.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from flipjax.runtime.host_image import HostImage
from flipjax.runtime.pool_programs import (
    gather_program,
    padded_ids,
    placed_zeros,
    put_program,
    replicated,
    zeros_program,
)
from sharding.memory import bytes_per_device
from sharding.movers import buckets

OnWave = Callable[[str, Counter[int]], None]


@dataclass(frozen=True)
class PoolLeaf:
    """One pool array's shape, and which ids of its rows are live."""

    shape: tuple[int, ...]
    dtype: Any
    ids: np.ndarray


def _whole(pool: PoolLeaf) -> bool:
    """Whether the live rows are every row of the pool, in order."""
    return len(pool.ids) == pool.shape[0] and bool(np.all(pool.ids == np.arange(pool.shape[0])))


def _row_bytes(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> int:
    """Bytes one row of the pool takes on each of its devices."""
    return int(np.prod(sharding.shard_shape((1, *shape[1:])))) * np.dtype(dtype).itemsize


def chunk_rows(
    shape: tuple[int, ...], dtype: Any, sharding: NamedSharding, window: Mapping[int, int]
) -> int:
    """The most rows one chunk of this pool moves: the largest bucket whose rows fit the
    window of every device the pool is on (at least one row)."""
    room = min(window[d.id] for d in sharding.device_set)
    row = _row_bytes(shape, dtype, sharding)
    fitting = [b for b in buckets(shape[0]) if b * row <= room]
    return fitting[-1] if fitting else 1


def _chunks(ids: np.ndarray, total: int, cap: int) -> list[tuple[np.ndarray, int]]:
    """`ids` cut into chunks of at most `cap`, each with its program's row count."""
    out = []
    for start in range(0, len(ids), cap):
        part = ids[start : start + cap]
        size = cap if len(part) == cap else min(b for b in buckets(total) if b >= len(part))
        out.append((part, size))
    return out


def _temp(program: Any, sharding: NamedSharding) -> Counter[int]:
    temp = program.memory_analysis().temp_size_in_bytes
    return Counter({d.id: temp for d in sharding.device_set})


def pull(
    leaves: Sequence[jax.Array],
    live: Sequence[np.ndarray],
    window: Mapping[int, int],
    on_wave: OnWave | None,
) -> list[np.ndarray]:
    """The rows `live[i]` of each pool `leaves[i]`, on the host."""
    out = []
    for leaf, ids in zip(leaves, live, strict=True):
        shape, sharding = tuple(leaf.shape), leaf.sharding
        if _whole(PoolLeaf(shape, leaf.dtype, ids)):  # the pool itself, read to the host
            out.append(np.array(leaf, copy=True))
            if on_wave is not None:
                on_wave("pull", Counter())
            continue
        cap = chunk_rows(shape, leaf.dtype, sharding, window)
        host = np.empty((len(ids), *shape[1:]), leaf.dtype)
        done = 0
        for part, size in _chunks(ids, shape[0], cap):
            gather = gather_program(shape, leaf.dtype, sharding, size)
            take = jax.device_put(padded_ids(part, size, 0), replicated(sharding))
            rows = gather(leaf, take)
            if on_wave is not None:
                on_wave("pull", _temp(gather, sharding))
            # Copied out: on the CPU `np.asarray` is a view that keeps the device buffer alive.
            host[done : done + len(part)] = np.asarray(rows)[: len(part)]
            done += len(part)
            del rows
        out.append(host)
    return out


def weight_waves(
    image: HostImage, shardings: Sequence[Any], indices: Sequence[int], window: Mapping[int, int]
) -> list[list[int]]:
    """The image's leaves `indices` in waves: each wave takes at most the window on every
    device (a leaf whose share alone is larger is a wave of its own)."""
    waves: list[list[int]] = [[]]
    load: Counter[Any] = Counter()
    for i in indices:
        need = bytes_per_device([image.leaves[i]], [shardings[i]])
        if waves[-1] and any(load[d] + n > window[d.id] for d, n in need.items()):
            waves.append([])
            load = Counter()
        waves[-1].append(i)
        load.update(need)
    return [w for w in waves if w]


def land(
    image: HostImage,
    weight_sh: Sequence[Any],
    weights: Sequence[int],
    pools: Sequence[PoolLeaf],
    pool_sh: Sequence[NamedSharding],
    rows: Sequence[np.ndarray],
    window: Mapping[int, int],
    on_wave: OnWave | None,
    landed: list[jax.Array],
) -> tuple[dict[int, jax.Array], list[jax.Array], list[float]]:
    """The image's leaves `weights` written on `weight_sh` (a sharding per image leaf), and
    each of `pools` rebuilt on its sharding with its live `rows`; every array made is appended
    to `landed` as it is made (so a failure can delete them). Returns the weights by index,
    the pools, and the ms the weights and then each pool took."""
    t0 = time.perf_counter()
    placed: dict[int, jax.Array] = {}
    for wave in weight_waves(image, weight_sh, weights, window):
        arrays = jax.block_until_ready(image.place(weight_sh, wave))
        landed.extend(arrays)
        placed.update(zip(wave, arrays, strict=True))
        if on_wave is not None:
            on_wave("weights", Counter())
    t1 = time.perf_counter()
    out = []
    pool_ms = [(t1 - t0) * 1e3]
    for pool, values, sharding in zip(pools, rows, pool_sh, strict=True):
        start = time.perf_counter()
        if _whole(pool):  # every row is live, in order: the host rows are the pool
            array = jax.block_until_ready(jax.device_put(values, sharding))
            landed.append(array)
            if on_wave is not None:
                on_wave("pools", Counter())
            out.append(array)
            pool_ms.append((time.perf_counter() - start) * 1e3)
            continue
        array = placed_zeros(pool.shape, pool.dtype, sharding)
        landed.append(array)
        cap = chunk_rows(pool.shape, pool.dtype, sharding, window)
        done = 0
        for part, size in _chunks(pool.ids, pool.shape[0], cap):
            put = put_program(pool.shape, pool.dtype, sharding, size)
            chunk = values[done : done + len(part)]
            if len(part) < size:  # padded to the program's rows; the padding's ids are dropped
                chunk = np.concatenate(
                    [chunk, np.zeros((size - len(part), *chunk.shape[1:]), chunk.dtype)]
                )
            done += len(part)
            ids = jax.device_put(padded_ids(part, size, pool.shape[0]), replicated(sharding))
            array = jax.block_until_ready(put(array, ids, jax.device_put(chunk, sharding)))
            landed.append(array)
            if on_wave is not None:
                on_wave("pools", _temp(put, sharding))
        out.append(jax.block_until_ready(array))
        pool_ms.append((time.perf_counter() - start) * 1e3)
    return placed, out, pool_ms


def compile_all(
    sides: Sequence[tuple[Sequence[tuple[tuple[int, ...], Any]], Sequence[NamedSharding]]],
    window: Mapping[int, int],
) -> None:
    """Compile, from shapes, every program a windowed flip between two layouts runs, both
    ways: each side is its pools' (shape, dtype) and their shardings, leaf for leaf."""
    for pools, leaf_shardings in sides:
        for (shape, dtype), sharding in zip(pools, leaf_shardings, strict=True):
            zeros_program(shape, dtype, sharding)
            cap = chunk_rows(shape, dtype, sharding, window)
            for size in buckets(shape[0]):
                if size > cap:
                    break
                gather_program(shape, dtype, sharding, size)
                put_program(shape, dtype, sharding, size)


def delete_all(arrays: Sequence[jax.Array]) -> None:
    for x in arrays:
        if not x.is_deleted():
            x.delete()
