"""The plan broadcast: process 0 runs the engine, and every device operation it makes is run by
every process, in the same order, with the same host arguments.

In JAX's multi-controller model each process must launch the same programs over the global
mesh. Only process 0 schedules, so it announces each device operation before running it: the
methods marked `@mirrored` (a step's rows, positions and page tables, a page write of store
payloads, a page copy, a flip's live set, ...). An announcement is the method's name and its
host arguments (encoded by `plan_codec` in msgpack, never pickle; a follower reads it back
allowing only the types an announcement holds, and only the names of mirrored methods), broadcast
with `multihost_utils.broadcast_one_to_all`: a collective over the same runtime as the model's
(gloo here, NCCL on GPUs), so no second transport is needed. The other processes `follow`:
receive, call the same method on their own objects, repeat.

A frame is fixed at `FRAME_BYTES` so that one collective (one compiled program) carries a
typical step; a larger message sends its rest in a second, power-of-two sized broadcast. A frame
declares its message's length, which is bounded (`MAX_MESSAGE_BYTES`): process 0 refuses to send
a longer message, and a follower refuses a frame declaring one before it allocates the rest. Only
the outermost mirrored call is announced: what it calls inside happens on every process anyway.
Sampling runs on process 0's device only, so sampling parameters and grammar masks are never
broadcast. Reads for the store come back to process 0 through
`flipjax.runtime.crosshost.to_host`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from jax.experimental import multihost_utils

from flipjax.runtime import multihost
from flipjax.runtime.buckets import pow2_bucket
from flipjax.runtime.plan_codec import PlanRefused, decode, encode

log = logging.getLogger("flipjax.mirror")

FRAME_BYTES = 4096
# The largest real message is a page write of a stored prefix: its KV pages and a GDN state. For
# the family's largest model (12 full-attention layers of 2 KV heads of 256, 36 GDN layers of
# 32 heads of 128 x 128 in float32) a whole 262,144-token context is 6 GiB of bfloat16 pages
# and 72 MiB of state; a bound below that would refuse real store hits.
MAX_MESSAGE_BYTES = 8 << 30
_HEADER = 8  # the message's length, then its first bytes
_STOP, _PING = "stop", "ping"
_MIRRORED: set[str] = {_STOP, _PING}  # the names an announcement may carry
F = TypeVar("F", bound=Callable[..., Any])


class Channel:
    """Process 0's side and the followers' side of the broadcast (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()  # sent, bytes, extra_frames
        self.seconds = 0.0  # spent broadcasting, on process 0

    def send(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        data = encode(name, args, kwargs)
        if len(data) > MAX_MESSAGE_BYTES:  # refused here, before any process is told of it
            raise PlanRefused(
                f"plan broadcast: {name}: {len(data)} bytes, over the {MAX_MESSAGE_BYTES}"
            )
        with self._lock:
            t0 = time.perf_counter()
            try:
                _broadcast_message(data)
            except Exception as err:  # noqa: BLE001 - a failed collective is a lost process
                raise multihost.ProcessLost(multihost.lost_processes(), err) from err
            self.seconds += time.perf_counter() - t0
            self.counters["sent"] += 1
            self.counters["bytes"] += len(data)
            self.counters["extra_frames"] += len(data) > FRAME_BYTES - _HEADER

    def receive(self) -> bytes:
        return _broadcast_message(None)


def _broadcast_message(data: bytes | None) -> bytes:
    """Broadcast `data` from process 0 (None elsewhere); every process gets it. `PlanRefused`
    for a frame declaring more than `MAX_MESSAGE_BYTES`."""
    frame = np.zeros(FRAME_BYTES, np.uint8)
    if data is not None:
        head = data[: FRAME_BYTES - _HEADER]
        frame[:_HEADER] = np.frombuffer(np.uint64(len(data)).tobytes(), np.uint8)
        frame[_HEADER : _HEADER + len(head)] = np.frombuffer(head, np.uint8)
    frame = np.asarray(multihost_utils.broadcast_one_to_all(frame))
    size = int(frame[:_HEADER].view(np.uint64)[0])
    if size > MAX_MESSAGE_BYTES:  # a corrupted or forged frame: allocate nothing for its rest
        raise PlanRefused(
            f"plan broadcast: a frame declares {size} bytes, over the {MAX_MESSAGE_BYTES}"
        )
    out = frame[_HEADER : _HEADER + size].tobytes()
    rest = size - len(out)
    if rest > 0:
        tail = np.zeros(pow2_bucket(rest), np.uint8)
        if data is not None:
            tail[:rest] = np.frombuffer(data[len(out) :], np.uint8)
        out += np.asarray(multihost_utils.broadcast_one_to_all(tail))[:rest].tobytes()
    return out


_channel: Channel | None = None  # set on process 0 of a cluster once its engine is built
_depth = threading.local()


def lead() -> Channel:
    """Start announcing (process 0 of a cluster, after the engine is built the same way in
    every process)."""
    global _channel
    if _channel is None:
        _channel = Channel()
    return _channel


def channel() -> Channel | None:
    return _channel


def mirrored(method: F) -> F:
    """Mark a device operation of a mirrored object (see `follow`): on process 0 of a cluster,
    its call is announced to the others before it runs. Its arguments must be host values."""
    name = method.__qualname__
    _MIRRORED.add(name)

    @functools.wraps(method)
    def announced(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = not getattr(_depth, "n", 0)
        if outer and _channel is not None:
            _channel.send(name, args, kwargs)
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _depth.n -= 1

    return announced  # type: ignore[return-value]


def ping() -> None:
    """Announce nothing (an idle process 0 keeps the others' collectives short, and learns of
    a lost process while no request runs)."""
    if _channel is not None:
        _channel.send(_PING, (), {})


def stop() -> None:
    """Tell the followers to return from `follow` (process 0 shutting down)."""
    global _channel
    if _channel is not None:
        try:
            _channel.send(_STOP, (), {})
        except multihost.ProcessLost:
            pass
        _channel = None


def follow(targets: dict[str, Any]) -> int:
    """Run process 0's device operations on this process's `targets` (class name -> object)
    until it stops; returns how many ran. `ProcessLost` when process 0 is gone, `PlanRefused`
    for a message process 0 could not have sent (this process cannot stay in step after it)."""
    chan, ran = Channel(), 0
    while True:
        try:
            data = chan.receive()
        except PlanRefused:
            raise
        except Exception as err:  # noqa: BLE001 - a failed collective is a lost process
            raise multihost.ProcessLost(multihost.lost_processes() or [0], err) from err
        name, args, kwargs = decode(data)
        if name not in _MIRRORED:
            raise PlanRefused(f"plan broadcast: {name!r} is not a mirrored operation")
        if name == _STOP:
            return ran
        if name == _PING:
            continue
        owner, _, method = name.partition(".")
        try:
            getattr(targets[owner], method)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - process 0 got it too, and refuses it there
            log.warning("%s failed here as on process 0: %s", name, err)
        ran += 1
