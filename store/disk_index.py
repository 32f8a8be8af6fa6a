"""The disk tier's index in memory: which entries are live, where, in LRU order, and how many
live bytes each segment holds. The tier's lock guards it; it does no I/O."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from store.keys import parse_name
from store.segments import DEAD, Location, Record


class DiskIndex:
    def __init__(self) -> None:
        self.entries: OrderedDict[str, Location] = OrderedDict()  # LRU first
        self.used = 0  # live bytes
        self.live: Counter[int] = Counter()  # live bytes per segment
        self.dead: list[Record] = []  # retirements not yet in an index file

    def place(self, name: str, at: Location) -> None:
        """Index an entry; a newer copy of one (compacted) keeps its LRU place."""
        old = self.entries.get(name)
        if old is not None:
            self._count_out(old)
        self.entries[name] = at
        self.used += at.length
        self.live[at.segment] += at.length

    def unplace(self, name: str, at: Location) -> None:
        """Replay a DEAD: it retires the entry only at the location it names."""
        if self.entries.get(name) == at:
            self._count_out(self.entries.pop(name))

    def retire(self, name: str) -> None:
        """Drop an entry; its DEAD record waits in `dead` for the next commit."""
        at = self.entries.pop(name)
        self._count_out(at)
        key, kind = parse_name(name)
        self.dead.append(Record(DEAD, key, kind, at))

    def make_room(
        self, incoming: int, budget: int, pinned: Callable[[str], int], fits: Callable[[], bool]
    ) -> int:
        """Retire unpinned entries, least recently used first, until `incoming` more bytes fit
        the budget and `fits()`; how many were retired."""
        retired = 0
        for name in list(self.entries):
            if self.used + incoming <= budget and fits():
                break
            if not pinned(name):
                self.retire(name)
                retired += 1
        return retired

    def in_segment(self, segment: int) -> list[tuple[str, Location]]:
        return [(n, at) for n, at in self.entries.items() if at.segment == segment]

    def _count_out(self, at: Location) -> None:
        self.used -= at.length
        self.live[at.segment] -= at.length
