"""Room for a flip: what the target placement allocates on each device, against what is free.

Until the swap the old arrays stay where they are, so every target device must fit the new
parameters and pools beside what it already holds. A device that reports `memory_stats`
(GPUs) is checked against its own free bytes, one with a `--device-memory` budget against
that budget; elsewhere (the CPU) against the `headroom`
budget a server names with `--flip-memory-headroom`, or not at all without one. In a cluster
process 0 decides, and it can read the stats of its own devices only: the others' are held to
the headroom.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax

from sharding.budgets import format_bytes, reserve


def bytes_per_device(trees: Any, shardings: Any) -> Counter[Any]:
    """Bytes each device holds of `trees` laid out by `shardings` (leaf for leaf)."""
    need: Counter[Any] = Counter()
    for leaf, sharding in zip(jax.tree.leaves(trees), jax.tree.leaves(shardings), strict=True):
        shard = math.prod(sharding.shard_shape(tuple(leaf.shape))) * leaf.dtype.itemsize
        for device in sharding.device_set:
            need[device] += shard
    return need


def bytes_by_id(trees: Any, shardings: Any) -> Counter[int]:
    """`bytes_per_device`, keyed by device id."""
    return Counter({d.id: n for d, n in bytes_per_device(trees, shardings).items()})


def held_bytes(tree: Any) -> Counter[int]:
    """Bytes each device (by id) holds of the placed arrays in `tree`."""
    return bytes_by_id(tree, jax.tree.map(lambda leaf: leaf.sharding, tree))


def shortfall(
    need: Counter[Any],
    headroom: int | None,
    budgets: Mapping[int, int] | None = None,
    held: Counter[int] | None = None,
) -> str | None:
    """Why the target cannot hold what moves, naming the numbers; None when it can. A device
    with a budget (`sharding.budgets`) has its budget less what it holds (`held`, by device id)
    and the reserve free."""
    for device, wanted in sorted(need.items(), key=lambda kv: kv[0].id):
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        if budgets is not None and device.id in budgets:
            budget = budgets[device.id]
            free = budget - (held or Counter())[device.id] - reserve(budget)
            source = f"--device-memory budget {format_bytes(budget)}"
        elif stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            source = "memory_stats"
        elif headroom is not None:
            free, source = headroom, "--flip-memory-headroom"
        else:
            continue
        if wanted > free:
            return (
                f"device {device.id} needs {wanted / 2**20:.1f} MiB for the target layout beside "
                f"what it holds, {free / 2**20:.1f} MiB are free ({source})"
            )
    return None


def live_bytes(exclude: set[int] | None = None) -> Counter[int]:
    """Bytes each device (by id) holds of every live array in this process (`jax.live_arrays`),
    leaving out the arrays whose `id` is in `exclude`: what a device really holds, for the
    bench and the tests to hold the ledger and the flip's window against. A buffer is counted
    once however many arrays view it (a shard's `.data` is itself a live array)."""
    buffers: dict[tuple[int, int], int] = {}
    for array in jax.live_arrays():
        if (exclude is not None and id(array) in exclude) or array.is_deleted():
            continue
        for shard in array.addressable_shards:
            data = shard.data
            buffers[(shard.device.id, data.unsafe_buffer_pointer())] = data.nbytes
    held: Counter[int] = Counter()
    for (device, _), size in buffers.items():
        held[device] += size
    return held
