"""Random paged attention inputs whose pages hold random data past each row's length, so that
anything a kernel reads without masking shows up in its result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def paged_case(
    seed: int,
    rows: list[tuple[int, int]],
    kv_heads: int,
    group: int,
    page_size: int,
    dtype: jnp.dtype,
    head_dim: int = 16,
) -> tuple[jax.Array, ...]:
    """rows: (context length after this step, new tokens this step); (0, 0) is an empty row.

    Each row's pages are distinct random pages of a shared pool; pool contents past a row's
    length are random too, so anything the kernel reads without masking shows up.
    """
    rng = np.random.default_rng(seed)
    t = max(1, max(new for _, new in rows))
    width = max(1, max(-(-length // page_size) for length, _ in rows)) + 2
    num_pages = len(rows) * width + 3
    perm = rng.permutation(num_pages)
    table = np.stack([perm[i * width : (i + 1) * width] for i in range(len(rows))])
    positions = np.full((len(rows), t), -1, np.int32)
    for i, (length, new) in enumerate(rows):
        positions[i, :new] = np.arange(length - new, length)
    h = kv_heads * group
    q = rng.standard_normal((len(rows), t, h, head_dim))
    k = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
    v = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(table, jnp.int32), jnp.asarray(positions)
