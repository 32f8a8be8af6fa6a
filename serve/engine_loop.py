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
from dataclasses import dataclass
from typing import Any

from flipjax.engine.pilot import Autopilot
from flipjax.runtime import mirror, multihost
from flipjax.runtime.multihost import ProcessLost
from serve.dispatch import Dispatcher
from serve.messages import Abort, Admitted, Message, Start, Update

log = logging.getLogger("flipjax.serve")


@dataclass(frozen=True)
class _Submit:
    requests: list[Start]
    notify: Callable[[Update], None]


@dataclass(frozen=True)
class _Queued:
    """A message on the loop's queue, with the future its answer goes to (None: nobody
    waits)."""

    message: _Submit | Message | None  # None wakes the loop
    done: Future[Any] | None = None


@dataclass
class _Request:
    notify: Callable[[Update], None]
    sent: int = 0


class EngineLoop:
    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self.engine = dispatcher.engine
        self.autopilot = dispatcher.autopilot  # the automatic phase policy, if on
        self._commands: queue.Queue[_Queued] = queue.Queue()
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

    def submit(self, requests: list[Start], notify: Callable[[Update], None]) -> list[Admitted]:
        """Queue `requests` on the loop thread, all or none; returns each one's choices once
        admitted. A refusal raises ValueError (bad input) or KeyError (an unknown checkpoint
        or session) and leaves nothing queued."""
        return self._send(_Submit(requests, notify))

    def abort(self, request_id: str) -> None:
        """Abort soon, without waiting (a client went away)."""
        self._commands.put(_Queued(Abort(request_id)))

    def cancel(self, request_id: str) -> bool:
        """Abort now; False if no such request is in flight."""
        return self._send(Abort(request_id))

    def call(self, message: Message) -> Any:
        """Apply `message` on the loop thread between two steps; its answer, or its error."""
        return self._send(message)

    def _send(self, message: _Submit | Message) -> Any:
        self._check_cluster()
        done: Future[Any] = Future()
        self._commands.put(_Queued(message, done))
        return self._wait(done)

    def close(self) -> None:
        self._stop.set()
        self._commands.put(_Queued(None))
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
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command.done is not None:
                command.done.set_exception(LoopDead(f"the engine loop stopped: {self.dead}"))

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
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            idle = False
            if self.lost is None and self.engine.has_unfinished():
                self._step()
                last = self.engine.last_step
                idle = last is not None and not (last.prefill_tokens or last.decode_rows)

    def _apply(self, command: _Queued) -> None:
        message, done = command.message, command.done
        if isinstance(message, _Submit):
            assert done is not None
            self._admit(message, done)
            return
        try:
            self._check_cluster()
            if message is None:
                result = None
            elif isinstance(message, Abort):
                result = self._abort(message.request_id)
            else:
                result = self.dispatcher.apply(message)
        except Exception as err:  # noqa: BLE001 - the caller's refusal, not the loop's
            if done is None:
                log.warning("engine loop: %s failed: %s", type(message).__name__, err)
            else:
                done.set_exception(err)
            return
        if done is not None:
            done.set_result(result)

    def _admit(self, submit: _Submit, admitted: Future[Any]) -> None:
        started: list[str] = []
        try:
            self._check_cluster()
            for request in submit.requests:
                started.append(self.dispatcher.start(request))
        except Exception as err:  # noqa: BLE001 - this request's failure, not the loop's
            for rid in started:
                for choice in self.engine.progress(rid).choices:
                    self.engine.abort(choice)
            admitted.set_exception(err)
            return
        answers = []
        for rid in started:
            progress = self.engine.progress(rid)
            answers.append(Admitted(progress.choices, progress.prompt_tokens, progress.sampling))
            for choice in progress.choices:
                self._live[choice] = _Request(submit.notify)
        admitted.set_result(answers)

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
            if req is not None and out.error is not None:  # its own fault: it alone fails
                req.notify(Update(out.request_id, [], error=out.error))
            elif req is not None:
                req.notify(Update(out.request_id, [], output=out))
        for rid, req in self._live.items():
            progress = self.engine.progress(rid, req.sent)
            if progress.new_ids:
                req.sent += len(progress.new_ids)
                new = progress.new_ids, progress.new_logprobs, progress.prompt_logprobs
                req.notify(Update(rid, *new))

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
