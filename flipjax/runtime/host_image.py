"""The weights as host arrays: what every placement of them is written from.

An engine keeps one host copy of its parameters, taken once before anything is placed. Placing
them (at start-up, in a flip, or when a failed flip puts the old layout back) writes each
device's shards straight from it, so no device ever stages a whole tensor that is not its own,
and a flip can free the old layout's weights before the new ones land: they are restored from
here, never rebuilt from a device copy. The image is read-only after it is taken.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from flipjax.runtime.crosshost import from_host


class HostImage:
    """Host arrays leaf for leaf with a parameter tree."""

    def __init__(self, treedef: Any, leaves: list[np.ndarray]):
        self.treedef = treedef
        self.leaves = leaves
        for leaf in leaves:
            leaf.flags.writeable = False

    @classmethod
    def of(cls, params: Any) -> HostImage | None:
        """The image of `params` (host or device arrays); None where this process cannot read
        every leaf whole (a tree spread over several processes' devices)."""
        leaves, treedef = jax.tree.flatten(params)
        if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
            return None
        # A copy even of host arrays: the caller's model may change or drop them.
        return cls(treedef, [np.array(x, copy=True) for x in leaves])

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.leaves)

    def place(self, shardings: Any, indices: list[int] | None = None) -> list[jax.Array]:
        """Leaves `indices` (default: all) on their shardings (`shardings` is a tree like the
        parameters), each device writing only its shards."""
        wanted = jax.tree.leaves(shardings)
        chosen = range(len(self.leaves)) if indices is None else indices
        return [from_host(self.leaves[i], wanted[i]) for i in chosen]

    def tree(self, leaves: list[jax.Array]) -> Any:
        return jax.tree.unflatten(self.treedef, leaves)
