"""A bounded job queue served by one background thread: how the tiered store does its slow
I/O (disk and network) without the serving loop ever waiting on it.

Consecutive writes to one tier go down as one `put_many` (a group commit on disk, a pipeline
on Redis). A full queue refuses the job and counts it; a failed job is counted and the worker
goes on, so a broken tier costs entries, never the server.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from store.entry import Kind

MAX_BATCH = 64  # entries per put_many: bounds the bytes one barrier or pipeline carries


class BatchWriter(Protocol):
    def put_many(self, items: list[tuple[bytes, Kind, bytes]]) -> list[bool]: ...


@dataclass(frozen=True)
class TierPut:
    """A queued write; the worker batches consecutive ones to the same tier."""

    tier: BatchWriter
    key: bytes
    kind: Kind
    payload: bytes


Job = Callable[[], object] | TierPut


class Worker:
    def __init__(self, name: str, counters: Counter[str], lock: threading.Lock, size: int):
        self.name = name
        self._counters = counters  # the store's, under its lock
        self._lock = lock
        self._queue: queue.Queue[Job | None] = queue.Queue(size)
        self._thread = threading.Thread(target=self._work, name=f"flipjax-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue `job`; False (and a counted `<name>_queue_full`) when the queue is full."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count(f"{self.name}_queue_full")
            return False
        self._count(f"{self.name}_queued")
        return True

    def flush(self) -> None:
        """Wait until every job queued so far has run."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _work(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while isinstance(jobs[-1], TierPut) and len(jobs) < MAX_BATCH:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run(jobs)
            finally:
                for _ in jobs:
                    self._queue.task_done()
            if jobs[-1] is None:
                return

    def _run(self, jobs: list[Job | None]) -> None:
        batch: list[TierPut] = []
        for job in [*jobs, None]:
            if isinstance(job, TierPut) and (not batch or batch[0].tier is job.tier):
                batch.append(job)
                continue
            if batch:
                items = [(p.key, p.kind, p.payload) for p in batch]
                self._guarded(lambda t=batch[0].tier, items=items: t.put_many(items))
                batch = []
            if isinstance(job, TierPut):
                batch.append(job)
            elif job is not None:
                self._guarded(job)

    def _guarded(self, job: Callable[[], object]) -> None:
        try:
            job()
        except Exception:  # a failed job must not kill the worker; count it
            self._count(f"{self.name}_errors")
