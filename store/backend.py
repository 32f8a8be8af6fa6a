"""The interface every store tier implements, so callers never depend on where bytes live.

A tier maps (key, kind) to a verified payload. `get` returns None for anything it cannot vouch
for (absent, partial, corrupt, foreign): a miss, never wrong bytes. Budgets are in bytes.
"""

from __future__ import annotations

import abc
from collections import Counter

from store.entry import Kind


class Pins(Counter):
    """Counted pins by name: an entry is held while its count is above zero, so two
    checkpoints may pin one entry and the first unpin leaves it held."""

    def release(self, name: object, what: str) -> None:
        """Drop one pin; `what` names the entry in the error when it holds none."""
        if self[name] <= 0:
            raise RuntimeError(f"{what} not pinned")
        self[name] -= 1
        if not self[name]:
            del self[name]


class StoreTier(abc.ABC):
    name: str
    counters: Counter[str]
    _used: int
    _budget: int

    @abc.abstractmethod
    def put(self, key: bytes, kind: Kind, payload: bytes) -> bool:
        """Store an entry; False (and a counted refusal) when it cannot be stored."""

    @abc.abstractmethod
    def get(self, key: bytes, kind: Kind) -> bytes | None:
        """The verified payload, or None."""

    @abc.abstractmethod
    def contains(self, key: bytes, kind: Kind) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: bytes, kind: Kind) -> bool: ...

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @abc.abstractmethod
    def resize(self, budget_bytes: int) -> None:
        """Change the budget; shrinking evicts down to it at once."""
