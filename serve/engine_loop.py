"""The engine loop: one thread owns the engine and steps it for every HTTP request at once.

Requests from any thread are queued as commands; the loop admits them, runs `engine.step()`
while there is work (continuous batching across clients), and after each step pushes every
request's new tokens to its subscriber. Aborts and layout flips are commands too, so a flip
happens between two steps (the step is quiesced by construction) and requests in flight carry
over; with the automatic phase policy on, the loop also measures each step and lets the policy
flip between two steps. A failing step fails the requests it ran, with the error, and the loop
keeps serving. In a cluster (`flipjax.runtime.mirror`) the loop pings the other processes while
idle; once one is lost it fails what runs, refuses the rest and says so (`lost`, `/health`).
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from flipjax.engine.engine import Engine, Output
from flipjax.engine.outputs import prompt_logprobs
from flipjax.engine.pilot import Autopilot
from flipjax.engine.sequence import TokenLogprob
from flipjax.runtime import mirror, multihost
from flipjax.runtime.multihost import ProcessLost

log = logging.getLogger("flipjax.serve")


@dataclass
class Update:
    """What a subscriber learns after a step about one of its requests: the tokens (and their
    logprobs, when asked) generated since its last update, or the end."""

    request_id: str
    new_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first tokens, if asked
    output: Output | None = None  # set once, when the request finished
    error: str | None = None  # set when the request failed inside the engine


@dataclass
class _Request:
    notify: Callable[[Update], None]
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
        self.lost: ProcessLost | None = None  # a process of the cluster died: nothing runs
        # The loop thread itself failed: nothing runs, /health is 503, and `on_death` ends the
        # process (non-zero), so that its supervisor restarts it rather than it wedging.
        self.dead: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._idle_s = _PING_S if multihost.current().multi else None
        self._thread = threading.Thread(target=self._run, name="flipjax-engine", daemon=True)
        self._thread.start()

    # -- called from any thread -----------------------------------------------------------------

    def submit(
        self, starts: list[Callable[[Engine], str]], notify: Callable[[Update], None]
    ) -> list[tuple[list[str], int]]:
        """Queue requests with each `start(engine)` (e.g. `engine.add_request(...)`) on the
        loop thread, all or none; returns each one's choice ids and prompt tokens once
        admitted. A refusal raises ValueError (bad input) or KeyError (an unknown checkpoint or
        session) and leaves nothing queued."""
        self._check_cluster()
        admitted: Future[list[tuple[list[str], int]]] = Future()
        self._commands.put(lambda: self._admit(starts, notify, admitted))
        return self._wait(admitted)

    def abort(self, request_id: str) -> None:
        """Abort soon, without waiting (a client went away)."""
        self._commands.put(lambda: self._abort(request_id))

    def cancel(self, request_id: str) -> bool:
        """Abort now; False if no such request is in flight."""
        return self.call(lambda _: self._abort(request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps (a flip, a stats read)."""
        self._check_cluster()
        done: Future[Any] = Future()

        def command() -> None:
            try:
                self._check_cluster()
                done.set_result(fn(self.engine))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                done.set_exception(err)

        self._commands.put(command)
        return self._wait(done)

    def close(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=30)
        mirror.stop()  # the other processes of a cluster return from following

    def _wait(self, done: Future[Any]) -> Any:
        """The command's result; a command queued as the loop died is never run, so the wait
        looks again now and then rather than forever."""
        while True:
            try:
                return done.result(timeout=_DEATH_CHECK_S)
            except FutureTimeout:
                self._check_cluster()

    def _check_cluster(self) -> None:
        if self.dead is not None:
            raise LoopDead(f"the engine loop stopped: {self.dead}")
        if self.lost is not None:
            raise self.lost

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - reported, then the process ends
            self.dead = err
            log.critical("engine loop died: %s", "".join(traceback.format_exception(err)))
            self._fail_all(f"internal error: the engine loop stopped ({err})")
            self._refuse_queued()
            if self.on_death is not None:
                self.on_death(err)

    def _refuse_queued(self) -> None:
        """Commands queued behind the death get the error instead of waiting forever."""
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return
            except Exception:  # noqa: BLE001, S110 - each already carries _check_cluster's error
                pass

    def _serve(self) -> None:
        idle = False  # the last step planned nothing: its queue's head awaits the store
        while not self._stop.is_set():
            busy = self.lost is None and self.engine.has_unfinished()
            try:
                if busy and idle:  # sleep a little instead of spinning; a command wakes it
                    command = self._commands.get(timeout=_IDLE_S)
                elif busy:
                    command = self._commands.get(block=False)
                else:
                    command = self._commands.get(timeout=self._idle_s)
            except queue.Empty:
                command = None
                if not busy and self.lost is None and self._idle_s is not None:
                    self._ping()
            while command is not None:
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            idle = False
            if self.lost is None and self.engine.has_unfinished():
                self._step()
                last = self.engine.last_step
                idle = last is not None and not (last.prefill_tokens or last.decode_rows)

    def _admit(
        self,
        starts: list[Callable[[Engine], str]],
        notify: Callable[[Update], None],
        admitted: Future[list[tuple[list[str], int]]],
    ) -> None:
        started: list[str] = []
        try:
            self._check_cluster()
            for start in starts:
                started.append(start(self.engine))
        except Exception as err:  # noqa: BLE001 - this request's failure, not the loop's
            for rid in started:
                for choice in self.engine.requests.choices(rid):
                    self.engine.abort(choice)
            admitted.set_exception(err)
            return
        requests = self.engine.requests
        choices = [(requests.choices(rid), requests.prompt_tokens(rid)) for rid in started]
        for rid in (c for group, _ in choices for c in group):
            self._live[rid] = _Request(notify)
        admitted.set_result(choices)

    def _abort(self, request_id: str) -> bool:
        req = self._live.pop(request_id, None)
        if req is None:
            return False
        out = self.engine.abort(request_id)
        req.notify(Update(request_id, [], output=out))
        return True

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as err:  # noqa: BLE001 - one bad step must not take the server down
            self.step_errors += 1
            log.error("engine step failed: %s", "".join(traceback.format_exception(err)))
            if self._idle_s is not None and not isinstance(err, ProcessLost):
                self._ping()  # a collective that failed mid-step: is a process gone?
            if isinstance(err, ProcessLost):
                self._lose(err)
            self._fail_all(f"internal error: {err}" if self.lost is None else str(self.lost))
            return
        self.steps += 1
        if self.autopilot is not None:
            self._pilot(self.autopilot)
        for out in finished:
            req = self._live.pop(out.request_id, None)
            if req is not None:
                req.notify(Update(out.request_id, [], output=out))
        for rid, req in self._live.items():
            ids, logprobs = self.engine.requests.generated(rid, req.sent)
            if ids:
                first = req.sent == 0
                req.sent += len(ids)
                prompt = prompt_logprobs(self.engine.requests[rid]) if first else None
                req.notify(Update(rid, ids, logprobs, prompt))

    def _fail_all(self, error: str) -> None:
        for rid, req in list(self._live.items()):
            self._live.pop(rid)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001, S110 - gone already, or the engine is broken
                pass
            req.notify(Update(rid, [], error=error))

    def _ping(self) -> None:
        try:
            mirror.ping()
        except ProcessLost as err:
            self._lose(err)
            self._fail_all(str(err))

    def _lose(self, err: ProcessLost) -> None:
        if self.lost is None:
            log.error("cluster: %s; refusing all work from now on", err)
        self.lost = err

    def _pilot(self, autopilot: Autopilot) -> None:
        autopilot.observe(self.engine.last_step)
        try:
            autopilot.tick(self.engine)  # refusals back off inside; this is for the unforeseen
        except Exception as err:  # noqa: BLE001 - the policy must not take the server down
            autopilot.counters["errors"] += 1
            autopilot.governor.failed(f"policy error: {err}", autopilot.clock())
            log.error("phase policy: %s", err)


class LoopDead(RuntimeError):
    """The engine loop's thread failed; the server serves nothing more."""


_DEATH_CHECK_S = 1.0
_IDLE_S = 0.002  # how long an idle loop sleeps between looks at the store
_PING_S = 0.5  # how often an idle process 0 of a cluster checks the others are there
