"""Counts XLA compilations made on behalf of one owner (an engine), from JAX's own events.

Shape buckets exist so that steady-state serving never compiles; this counter is how tests and
metrics see that. Compilation happens synchronously inside the call that triggers it, so a
thread-local "who is calling" is enough to attribute each event.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_current = threading.local()


def _on_event(event: str, duration_secs: float, **_: object) -> None:
    counter = getattr(_current, "counter", None)
    if event == _BACKEND_COMPILE_EVENT and counter is not None:
        counter.count += 1
        counter.seconds += duration_secs


jax.monitoring.register_event_duration_secs_listener(_on_event)


class CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    @contextmanager
    def watch(self) -> Iterator[None]:
        previous = getattr(_current, "counter", None)
        _current.counter = self
        try:
            yield
        finally:
            _current.counter = previous
