"""The engine's session checkpoint operations, a part of `Engine`'s API: checkpoint a request in
flight or a session, branch from a checkpoint, rewind a session, list and delete checkpoints
(the work is in `sessions` and `store.checkpoints`)."""

from __future__ import annotations

from typing import Any

from flipjax.engine.requests import Requests
from flipjax.engine.sessions import Sessions
from flipjax.runtime.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from store.checkpoints import CheckpointBook


class CheckpointAPI:
    sessions: Sessions
    requests: Requests

    def settle(self) -> None:
        raise NotImplementedError

    @property
    def checkpoints(self) -> CheckpointBook | None:
        return self.sessions.book_or_none

    def checkpoint(
        self, request_id: str | None = None, session_id: str | None = None,
        position: int | None = None, quiesce: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Checkpoint a request in flight (only with `quiesce`: it is paused at this step
        boundary, checkpointed and resumes) or a session, at `position` tokens (default: all of
        them). Returns the checkpoint's summary; refusals raise CheckpointError or KeyError."""
        self.settle()
        return self.sessions.checkpoint(
            request_id, session_id, position, quiesce, self.requests.__getitem__
        )

    def branch(
        self, checkpoint_id: str, sampling: SamplingParams | None = None,
        max_new_tokens: int = DEFAULT_MAX_TOKENS, request_id: str | None = None,
        session_id: str | None = None, prompt: str | list[int] | None = None,
    ) -> str:  # fmt: skip
        """Queue a request that continues from a checkpoint exactly (its sampling and RNG state
        unless `sampling` overrides them), or after it with a new turn `prompt`; its id."""
        encode = self.requests.encode
        seq = self.sessions.branch(checkpoint_id, sampling, session_id, prompt, encode)
        return self.requests.enqueue(seq, seq.params, max_new_tokens, request_id)

    def rewind(self, session_id: str, checkpoint_id: str) -> None:
        """Make `session_id` continue from a checkpoint (creating the session if need be)."""
        self.sessions.rewind(session_id, checkpoint_id)

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return self.sessions.book.list()

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Unpin what the checkpoint referenced; KeyError when unknown."""
        self.sessions.book.delete(checkpoint_id)
