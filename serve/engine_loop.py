"""The engine loop: one thread owns the engine and steps it for every HTTP request at once.

Requests from any thread are queued as commands; the loop admits them, runs `engine.step()`
while there is work (continuous batching across clients), and after each step pushes every
request's new tokens to its subscriber. Aborts and layout flips are commands too, so a flip
happens between two steps (the step is quiesced by construction) and requests in flight carry
over; with the automatic phase policy on, the loop also measures each step and lets the policy
flip between two steps. A failing step fails the requests it ran, with the error, and the loop
keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flipjax.engine.engine import Engine, Output
from flipjax.engine.pilot import Autopilot

log = logging.getLogger("flipjax.serve")


@dataclass
class Update:
    """What a subscriber learns after a step: the tokens generated since its last update, or
    the end."""

    new_ids: list[int]
    output: Output | None = None  # set once, when the request finished
    error: str | None = None  # set when the request failed inside the engine


@dataclass
class _Request:
    start: Callable[[Engine], str]  # queues the request on the engine, returns its id
    notify: Callable[[Update], None]
    admitted: Future[str] = field(default_factory=Future)  # the id, or the refusal
    request_id: str | None = None
    sent: int = 0


class EngineLoop:
    def __init__(self, engine: Engine, autopilot: Autopilot | None = None):
        self.engine = engine
        self.autopilot = autopilot  # the automatic phase policy, if on
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._stop = threading.Event()
        self.steps = 0
        self.step_errors = 0
        self._thread = threading.Thread(target=self._run, name="flipjax-engine", daemon=True)
        self._thread.start()

    # -- called from any thread -----------------------------------------------------------------

    def submit(self, start: Callable[[Engine], str], notify: Callable[[Update], None]) -> str:
        """Queue a request with `start(engine)` (e.g. `engine.add_request(...)`) on the loop
        thread; returns its id once admitted. A refusal raises ValueError (bad input) or
        KeyError (an unknown checkpoint or session)."""
        req = _Request(start, notify)
        self._commands.put(lambda: self._admit(req))
        return req.admitted.result()

    def abort(self, request_id: str) -> None:
        """Abort soon, without waiting (a client went away)."""
        self._commands.put(lambda: self._abort(request_id))

    def cancel(self, request_id: str) -> bool:
        """Abort now; False if no such request is in flight."""
        return self.call(lambda _: self._abort(request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps (a flip, a stats read)."""
        done: Future[Any] = Future()

        def command() -> None:
            try:
                done.set_result(fn(self.engine))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                done.set_exception(err)

        self._commands.put(command)
        return done.result()

    def close(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=30)

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            try:
                command = self._commands.get(block=not busy, timeout=None)
            except queue.Empty:
                command = None
            while command is not None:
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished():
                self._step()

    def _admit(self, req: _Request) -> None:
        try:
            rid = req.start(self.engine)
        except (ValueError, KeyError) as err:
            req.admitted.set_exception(err)
            return
        req.request_id = rid
        self._live[rid] = req
        req.admitted.set_result(rid)

    def _abort(self, request_id: str) -> bool:
        req = self._live.pop(request_id, None)
        if req is None:
            return False
        out = self.engine.abort(request_id)
        req.notify(Update([], output=out))
        return True

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as err:  # noqa: BLE001 - one bad step must not take the server down
            self.step_errors += 1
            log.error("engine step failed: %s", "".join(traceback.format_exception(err)))
            for rid, req in list(self._live.items()):
                self._live.pop(rid)
                try:
                    self.engine.abort(rid)
                except KeyError:
                    pass
                req.notify(Update([], error=f"internal error: {err}"))
            return
        self.steps += 1
        if self.autopilot is not None:
            self._pilot(self.autopilot)
        for out in finished:
            req = self._live.pop(out.request_id, None)
            if req is not None:
                req.notify(Update([], output=out))
        for rid, req in self._live.items():
            ids = self.engine.generated(rid, req.sent)
            if ids:
                req.sent += len(ids)
                req.notify(Update(ids))

    def _pilot(self, autopilot: Autopilot) -> None:
        autopilot.observe(self.engine.last_step)
        try:
            autopilot.tick(self.engine)
        except Exception as err:  # noqa: BLE001 - a refused or failed flip keeps the old layout
            autopilot.counters["refusals"] += 1
            autopilot.last_decision = f"flip failed, staying: {err}"
            log.error("phase policy: %s", err)
