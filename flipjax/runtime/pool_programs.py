"""The programs that build a pool where it lives and move its rows in and out through the host.

A pool is made by a program whose output is already laid out by its sharding (each device
allocates only its shard; nothing is staged on one device and copied). Rows leave a pool by a
gather on the pool's own devices and come back by a scatter that donates the pool, so writing
rows never holds a second pool. Every program is compiled from shapes (`jax.ShapeDtypeStruct`),
so arming a layout compiles them without allocating anything, and kept here per process by
what it was compiled for.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_PROGRAMS: dict[tuple[Any, ...], Any] = {}
Shape = tuple[int, ...]


def replicated(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, PartitionSpec())


def _compiled(key: tuple[Any, ...], build: Any) -> Any:
    program = _PROGRAMS.get(key)
    if program is None:
        program = _PROGRAMS[key] = build()
    return program


def _spec(shape: Shape, dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def zeros_program(shape: Shape, dtype: Any, sharding: NamedSharding) -> Any:
    """() -> a pool of zeros of `shape`, laid out by `sharding`."""
    dtype = jnp.dtype(dtype)

    def build() -> Any:
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding).lower().compile()

    return _compiled(("zeros", shape, dtype, sharding), build)


def gather_program(shape: Shape, dtype: Any, sharding: NamedSharding, rows: int) -> Any:
    """(pool, ids) -> the `rows` rows at `ids`, on the pool's devices and laid out like it."""
    dtype = jnp.dtype(dtype)

    def build() -> Any:
        program = jax.jit(lambda pool, ids: pool[ids], out_shardings=sharding)
        ids = _spec((rows,), jnp.int32, replicated(sharding))
        return program.lower(_spec(shape, dtype, sharding), ids).compile()

    return _compiled(("gather", shape, dtype, sharding, rows), build)


def put_program(shape: Shape, dtype: Any, sharding: NamedSharding, rows: int) -> Any:
    """(pool, ids, rows) -> the pool with `rows` written at `ids` (ids past the end are
    padding, dropped); the pool is donated, so it is written in place."""
    dtype = jnp.dtype(dtype)

    def build() -> Any:
        program = jax.jit(
            lambda pool, ids, values: pool.at[ids].set(values, mode="drop"),
            donate_argnums=0,
            out_shardings=sharding,
        )
        ids = _spec((rows,), jnp.int32, replicated(sharding))
        values = _spec((rows, *shape[1:]), dtype, sharding)
        return program.lower(_spec(shape, dtype, sharding), ids, values).compile()

    return _compiled(("put", shape, dtype, sharding, rows), build)


def placed_zeros(shape: Shape, dtype: Any, sharding: NamedSharding) -> jax.Array:
    """A pool of zeros made where `sharding` puts it."""
    return zeros_program(shape, dtype, sharding)()


def padded_ids(ids: np.ndarray, size: int, pad: int) -> np.ndarray:
    """`ids` padded to `size` with `pad`."""
    out = np.full(size, pad, np.int32)
    out[: len(ids)] = ids
    return out
