"""The engine's session checkpoint operations, a part of `Engine`'s API: checkpoint a request in
flight or a session, branch from a checkpoint, rewind a session, list and delete checkpoints,
and read a session (the work is in `sessions` and `store.checkpoints`)."""

from __future__ import annotations

import copy
from typing import Any

from flipjax.engine.assembly import Parts
from flipjax.engine.sessions import Session
from flipjax.runtime.sampling import DEFAULT_MAX_TOKENS, SamplingParams


class CheckpointAPI:
    _parts: Parts

    def _settle(self) -> None:
        raise NotImplementedError

    def checkpoint(
        self,
        request_id: str | None = None,
        session_id: str | None = None,
        position: int | None = None,
        quiesce: bool = False,
    ) -> dict[str, Any]:
        """Checkpoint a request in flight (only with `quiesce`: it is paused at this step
        boundary, checkpointed and resumes) or a session, at `position` tokens (default: all of
        them). Returns the checkpoint's summary; refusals raise CheckpointError or KeyError."""
        self._settle()
        p = self._parts
        lookup = p.requests.__getitem__
        return p.sessions.checkpoint(request_id, session_id, position, quiesce, lookup)

    def branch(
        self,
        checkpoint_id: str,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = DEFAULT_MAX_TOKENS,
        request_id: str | None = None,
        session_id: str | None = None,
        prompt: str | list[int] | None = None,
    ) -> str:
        """Queue a request that continues from a checkpoint exactly (its sampling and RNG state
        unless `sampling` overrides them), or after it with a new turn `prompt`; its id."""
        p = self._parts
        seq = p.sessions.branch(checkpoint_id, sampling, session_id, prompt, p.requests.encode)
        return p.requests.enqueue(seq, seq.params, max_new_tokens, request_id)

    def rewind(self, session_id: str, checkpoint_id: str) -> None:
        """Make `session_id` continue from a checkpoint (creating the session if need be)."""
        self._parts.sessions.rewind(session_id, checkpoint_id)

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return self._parts.sessions.book.list()

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Unpin what the checkpoint referenced; KeyError when unknown."""
        self._parts.sessions.book.delete(checkpoint_id)

    def session(self, session_id: str) -> Session | None:
        """A session's tokens and conversation so far; None when there is no such session."""
        session = self._parts.sessions.get(session_id)
        return copy.deepcopy(session)  # the caller's to keep: it must not change under them
