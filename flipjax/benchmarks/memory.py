"""Peak resident memory of this process over a block of code, sampled from /proc."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """`with PeakRSS() as p: ...`, then `p.peak_delta` is the peak RSS above the start."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0

    @property
    def peak_delta(self) -> int:
        return self.peak - self.start

    @contextmanager
    def _sampling(self) -> Iterator[None]:
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.interval_s):
                self.peak = max(self.peak, rss_bytes())

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._cm = self._sampling()
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
