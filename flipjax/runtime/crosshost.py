"""Moving arrays between device sets that span processes, with collectives only.

In one process `jax.device_put` moves anything anywhere. Across processes it only reshards
within one device set; a flip between `tp:4` over two processes and a pipeline with one stage
on each, or a pipeline's hand-off from a stage on one host to a stage on another, needs more.
`reshard` replicates the array on its own devices, then spreads it to the union of both device
sets with one program (a `psum` in which only the first source device contributes, the trick
`multihost_utils.broadcast_one_to_all` uses, over the same gloo/NCCL runtime as the model), and
cuts each local replica to the target's shard. Every process must make the same calls in the same
order; they do, since each runs the same device operations (`flipjax.runtime.mirror`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from flipjax.runtime import multihost

Devices = tuple[jax.Device, ...]


def _ordered(devices: Any) -> Devices:
    return tuple(sorted(devices, key=lambda d: d.id))


def _replicated_on(devices: Devices) -> NamedSharding:
    return NamedSharding(Mesh(np.array(devices), ("all",)), PartitionSpec())


@functools.cache
def _identity(sharding: Sharding) -> Any:
    return jax.jit(lambda x: x, out_shardings=sharding)


def settle(x: Any) -> Any:
    """`x`, computed, in a cluster. On CPUs a collective program waits in a worker thread
    for its peers, and two in flight at once can hold every thread while each waits for the
    other's peers; so across processes these moves run one at a time."""
    return jax.block_until_ready(x) if multihost.current().multi else x


def replicate(x: jax.Array) -> jax.Array:
    """`x` whole on every device it is on (a collective when they span processes)."""
    if x.sharding.is_fully_replicated:
        return x
    return settle(_identity(_replicated_on(_ordered(x.sharding.device_set)))(x))


def from_host(host: Any, sharding: Sharding) -> Any:
    """Host arrays (a pytree of them) that every process holds alike, laid out by `sharding`.
    In a cluster each process writes its own shards: `jax.device_put` would first compare the
    value across processes, one more collective per input of every step."""
    if not multihost.current().multi:
        return jax.device_put(host, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(
            a.shape, sharding, lambda index: a[index], dtype=a.dtype
        ),
        host,
    )


@functools.cache
def _spread_program(devices: Devices) -> tuple[Mesh, Any]:
    mesh = Mesh(np.array(devices), ("all",))
    spread = jax.shard_map(
        lambda block: jax.lax.psum(block, "all")[0],
        mesh=mesh,
        in_specs=PartitionSpec("all"),
        out_specs=PartitionSpec(),
    )
    return mesh, jax.jit(spread)


def _spread(whole: jax.Array, union: Devices) -> dict[jax.Device, jax.Array]:
    """The local replicas, on every device of `union`, of `whole` (replicated on a subset)."""
    first = _ordered(whole.sharding.device_set)[0]
    mine = {s.device: s.data for s in whole.addressable_shards}
    mesh, spread = _spread_program(union)
    blocks = [
        mine[d][None] if d == first else jnp.zeros((1, *whole.shape), whole.dtype, device=d)
        for d in mesh.devices.flat
        if d.process_index == jax.process_index()
    ]
    stacked = jax.make_array_from_single_device_arrays(
        (len(union), *whole.shape),
        NamedSharding(mesh, PartitionSpec("all")),
        blocks,
        dtype=whole.dtype,
    )
    return {s.device: s.data for s in settle(spread(stacked)).addressable_shards}


def reshard(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)`, also between device sets on different processes, by
    compiled programs only (JAX's cross-host transfers are not used)."""
    if not multihost.current().multi:
        return jax.device_put(tree, shardings)
    return jax.tree.map(_reshard_leaf, tree, shardings)


def _reshard_leaf(x: jax.Array, target: Sharding) -> jax.Array:
    source = x.sharding.device_set
    if source == target.device_set:  # one program; its collectives run on the model's runtime
        return settle(_identity(target)(x))
    whole = replicate(x)
    if target.device_set <= source:
        replicas = {s.device: s.data for s in whole.addressable_shards}
    else:
        replicas = _spread(whole, _ordered(source | target.device_set))
    shards = [
        jax.device_put(replicas[d][index], d)
        for d, index in target.addressable_devices_indices_map(x.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(x.shape, target, shards, dtype=x.dtype)


def program_inputs(host: Any, sharding: Sharding) -> Any:
    """Host arrays (a pytree of them) as the arguments of a program compiled to take them laid
    out by `sharding`. On one process they stay on the host: the program's own dispatch places
    them, in C++, where a `jax.device_put` per step costs a decode step's host thread a few
    hundred microseconds of Python that the device's threads want on a small machine. In a
    cluster, `from_host`'s."""
    return from_host(host, sharding) if multihost.current().multi else host


def on_device(x: jax.Array | np.ndarray, device: jax.Device) -> jax.Array:
    """`x` committed to `device` alone, as `jax.device_put(x, device)` places it (a program
    compiled for that placement takes it without compiling again), without the few tens of
    microseconds of host time such a put costs where `x` is there already."""
    if isinstance(x, jax.Array) and x.sharding == SingleDeviceSharding(device):
        return x
    return jax.device_put(x, device)


def to_leader(x: jax.Array, device: jax.Device) -> jax.Array:
    """A replicated array `x`, as one array on process 0's `device` (`x` itself elsewhere)."""
    if not multihost.current().multi:
        return x if x.sharding.device_set == {device} else jax.device_put(x, device)
    source = x.sharding.device_set
    if device in source:
        replicas = {s.device: s.data for s in x.addressable_shards}
    else:
        replicas = _spread(x, _ordered(source | {device}))
    return replicas[device] if multihost.current().leader else x


def to_host(tree: Any) -> Any:
    """Arrays to numpy on process 0, gathered whole however they are sharded; zeros of the same
    shapes on the other processes, which only take part."""
    if not multihost.current().multi:
        return jax.device_get(tree)

    def one(x: jax.Array) -> np.ndarray:
        x = to_leader(replicate(x), jax.devices()[0])
        return np.asarray(x) if multihost.current().leader else np.zeros(x.shape, x.dtype)

    return jax.tree.map(one, tree)
