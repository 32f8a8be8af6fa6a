"""The disk tier's log: appending framed entries and index records to segments, replaying the
indexes at open, reading an entry back, and dropping a compacted segment.

It keeps no policy (budgets, eviction, visibility are `store.disk.DiskTier`'s): it says where
bytes are, and makes them durable in the order a crash needs, entries before the records that
describe them. The file formats are `store.segments`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from store import durable
from store.entry import HEADER_BYTES, Kind
from store.segments import (
    DEAD,
    PUT,
    Location,
    Record,
    cut_tail,
    idx_path,
    read_index,
    seg_path,
    segment_ids,
)

Framed = tuple[bytes | memoryview, bytes | memoryview]  # an entry's header, then its payload
# A read that fails with an I/O error is tried again after each of these pauses (a busy or
# briefly unreachable disk) before the error is raised.
READ_RETRY_PAUSES_S = (0.005, 0.05)


class SegmentLog:
    def __init__(self, folder: str, segment_bytes: int):
        self.folder = folder
        self.segment_bytes = segment_bytes
        self.sizes: dict[int, int] = {}  # bytes written per segment
        self.tombs: dict[int, list[Record]] = {}  # the DEAD records each index file holds
        self.torn = 0  # replays that cut a torn index tail or unindexed entry bytes
        self.read_retries = 0  # reads tried again after an I/O error
        self._fds: dict[int, int] = {}
        os.makedirs(folder, exist_ok=True)

    def replay(self) -> Iterator[Record]:
        """Every whole record, in the order written; torn tails are cut as they are met."""
        for segment in segment_ids(self.folder):
            records, torn = read_index(self.folder, segment)
            size = os.path.getsize(seg_path(self.folder, segment))
            end, lost = 0, 0
            for r in records:
                if r.op == PUT and (r.at.segment != segment or r.at.offset + r.at.length > size):
                    lost += 1  # a record whose entry never fully reached the segment: untrusted
                    continue
                if r.op == PUT:
                    end = max(end, r.at.offset + r.at.length)
                else:
                    self.tombs.setdefault(segment, []).append(r)
                yield r
            if cut_tail(self.folder, segment, end) or torn or lost:
                self.torn += 1
            self.sizes[segment] = end

    def active(self) -> int:
        """The segment appends go to; a full one is sealed and a new one begun."""
        active = max(self.sizes, default=0)
        if not self.sizes or self.sizes[active] >= self.segment_bytes:
            active += 1
            self.sizes[active] = 0
            open(seg_path(self.folder, active), "ab").close()
        return active

    def seal(self) -> None:
        """Start a new segment for the next append, so the current one can be compacted."""
        if self.sizes and self.sizes[max(self.sizes)] > 0:
            self.sizes[max(self.sizes) + 1] = 0
            open(seg_path(self.folder, max(self.sizes)), "ab").close()

    def append(self, plan: list[tuple[bytes, Kind, Framed]]) -> list[Record]:
        """Write framed entries (header, payload) at the segments' ends and make them durable
        (one barrier); their PUT records, not yet written. What a failure left in a file is
        dead space."""
        records, pending = [], {}
        for key, kind, (head, payload) in plan:
            active = self.active()
            offset = self.sizes[active]
            length = len(head) + len(payload)
            self.sizes[active] = offset + length
            pending.setdefault(active, []).extend((head, payload))
            crc = int.from_bytes(head[HEADER_BYTES - 4 : HEADER_BYTES], "little")
            records.append(Record(PUT, key, kind, Location(active, offset, length, crc)))
        try:
            for segment, parts in pending.items():
                _append_all(seg_path(self.folder, segment), parts)
            if pending:
                durable.barrier(self.folder, [seg_path(self.folder, s) for s in sorted(pending)])
        except BaseException:
            for segment in pending:
                self.sizes[segment] = os.path.getsize(seg_path(self.folder, segment))
            raise
        return records

    def write_records(self, records: list[Record]) -> None:
        """Append records to the index files and make them durable (one barrier): a PUT beside
        its entry, a DEAD in the active segment's index."""
        by_index: dict[int, list[Record]] = {}
        active = self.active() if any(r.op == DEAD for r in records) else 0
        for r in records:
            by_index.setdefault(r.at.segment if r.op == PUT else active, []).append(r)
        for segment, group in by_index.items():
            with open(idx_path(self.folder, segment), "ab") as f:
                f.write(b"".join(r.pack() for r in group))
            self.tombs.setdefault(segment, []).extend(r for r in group if r.op == DEAD)
        if by_index:
            durable.barrier(self.folder, [idx_path(self.folder, s) for s in sorted(by_index)])

    def read(self, at: Location) -> tuple[bytes, bytes]:
        """The header and payload at `at`, as they are on disk (the caller verifies them). Two
        reads, so the payload comes back without a copy. An I/O error is retried (after each
        of `READ_RETRY_PAUSES_S`) before it is raised."""
        for pause in READ_RETRY_PAUSES_S:
            try:
                return self._read_once(at)
            except OSError:
                self.read_retries += 1
                time.sleep(pause)
        return self._read_once(at)

    def _read_once(self, at: Location) -> tuple[bytes, bytes]:
        fd = self._fd(at.segment)
        head = os.pread(fd, HEADER_BYTES, at.offset)
        return head, os.pread(fd, max(0, at.length - HEADER_BYTES), at.offset + HEADER_BYTES)

    def read_many(self, locations: list[Location]) -> list[memoryview]:
        """The bytes at each location, in order; a run of adjacent ones is one read."""
        order = sorted(range(len(locations)), key=lambda i: _span(locations[i]))
        out: list[memoryview] = [memoryview(b"")] * len(locations)
        run: list[int] = []
        for i in [*order, None]:
            if i is not None and run and _span(locations[i]) == _end(locations[run[-1]]):
                run.append(i)
                continue
            if run:
                first, last = locations[run[0]], locations[run[-1]]
                span = os.pread(self._fd(first.segment), _end(last)[1] - first.offset, first.offset)
                view = memoryview(span)
                for j in run:
                    start = locations[j].offset - first.offset
                    out[j] = view[start : start + locations[j].length]
            run = [] if i is None else [i]
        return out

    def _fd(self, segment: int) -> int:
        fd = self._fds.get(segment)
        if fd is None:
            fd = self._fds[segment] = os.open(seg_path(self.folder, segment), os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def carried_tombs(self, segment: int) -> list[Record]:
        """The retirements `segment`'s index holds of entries in other segments still here:
        they must outlive the segment, or a replay would bring those entries back."""
        return [
            t
            for t in self.tombs.get(segment, [])
            if t.at.segment in self.sizes and t.at.segment != segment
        ]

    def drop(self, segment: int) -> None:
        fd = self._fds.pop(segment, None)
        if fd is not None:
            os.close(fd)
        for path in (seg_path(self.folder, segment), idx_path(self.folder, segment)):
            os.remove(path)
        self.sizes.pop(segment)
        self.tombs.pop(segment, None)


def _append_all(path: str, parts: list[bytes | memoryview]) -> None:
    """Append buffers with vectored writes: framing an entry costs no copy of its payload."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        views = [memoryview(p) for p in parts if p]
        while views:
            n = os.writev(fd, views[:_IOV_MAX])
            while views and n >= len(views[0]):  # short writes resume where they stopped
                n -= len(views.pop(0))
            if views and n:
                views[0] = views[0][n:]
    finally:
        os.close(fd)


_IOV_MAX = 512  # buffers per writev call, under every system's limit


def _span(at: Location) -> tuple[int, int]:
    return at.segment, at.offset


def _end(at: Location) -> tuple[int, int]:
    return at.segment, at.offset + at.length
