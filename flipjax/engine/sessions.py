"""Sessions and checkpoints, as the engine sees them; `store.checkpoints.CheckpointBook` keeps
the checkpoints, `Sessions` holds the conversations and turns requests into checkpoints and
branches.

A session is a conversation: the tokens of every turn so far, where the last turn's prompt
ended, that turn's sampling parameters and seed, and the chat messages of a chat session. A
checkpoint freezes that state at a position. Positions are snapped down to the GDN checkpoint
grid for what the store must hold (KV pages and the GDN anchor end there); the tokens between
the snapped and the requested position are recomputed on a branch, so the continuation is
exactly the one the original request would have produced.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flipjax.engine.sequence import Sequence
from flipjax.runtime.sampling import SamplingParams
from store.checkpoints import CheckpointBook, CheckpointError, CheckpointState


@dataclass
class Session:
    token_ids: list[int]
    prompt_len: int  # the last turn's prompt; the rest of token_ids it generated
    sampling: SamplingParams
    seed: int
    chat: list[dict[str, str]] | None = None


def capture(
    tokens: list[int],
    computed: int,
    prompt_len: int,
    sampling: SamplingParams,
    seed: int,
    chat: list[dict[str, str]] | None,
    position: int | None,
    grid: int,
) -> CheckpointState:
    """A checkpoint of `tokens` (of which `computed` have their state on the device) at
    `position` (default: all of them), snapped down to the grid and never past what was
    computed. Refuses a position out of range or one that snaps to 0."""
    requested = len(tokens) if position is None else position
    if not 0 < requested <= len(tokens):
        raise CheckpointError(f"position: {requested} is outside 1..{len(tokens)}")
    used = min(requested, computed) // grid * grid
    if used == 0:
        raise CheckpointError(
            f"position: {requested} snaps to 0 on the {grid}-token GDN grid; there is no state "
            "to resume from"
        )
    return CheckpointState(
        tokens[:requested], min(prompt_len, requested), used, sampling, seed, chat
    )


def continuation(
    state: CheckpointState,
    sampling: SamplingParams | None,
    session_id: str | None,
    new_turn: list[int] | None,
) -> Sequence:
    """The request a branch queues (id and max_tokens still to set). Without `new_turn` it
    carries the checkpoint's generated tokens and RNG state, so it draws exactly what the
    original would have; with one, the checkpoint's tokens are the context of a new turn."""
    params = sampling if sampling is not None else state.sampling.replace(max_tokens=None)
    if new_turn is not None:
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        return Sequence("", state.token_ids + new_turn, params, 0, seed, session_id=session_id)
    seed = params.seed if params.seed is not None else state.seed
    seq = Sequence(
        "",
        state.token_ids[: state.prompt_len],
        params,
        0,
        seed,
        output_ids=state.token_ids[state.prompt_len :],
        session_id=session_id,
        chat=state.chat,
    )
    seq.carried = len(seq.output_ids)
    return seq


class Sessions:
    """The conversations by id, and the checkpoint book they are checkpointed into (None: this
    engine has no store, and every checkpoint operation is refused)."""

    def __init__(self, book: CheckpointBook | None, grid: int):
        self.book_or_none = book
        self.grid = grid
        self._sessions: dict[str, Session] = {}

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def context(self, session_id: str | None, chat: list[dict[str, str]] | None) -> list[int]:
        """The tokens a session's next turn follows: its tokens so far, unless the turn was
        rendered from the whole conversation (`chat`) or there is no such session yet."""
        session = self._sessions.get(session_id) if session_id is not None else None
        return session.token_ids if session is not None and chat is None else []

    @property
    def book(self) -> CheckpointBook:
        if self.book_or_none is None:
            raise CheckpointError("checkpoint: this engine has no store to keep checkpoints in")
        return self.book_or_none

    def checkpoint(
        self,
        request_id: str | None,
        session_id: str | None,
        position: int | None,
        quiesce: bool,
        in_flight: Callable[[str], Sequence],
    ) -> dict[str, Any]:
        """Checkpoint a request in flight (only with `quiesce`) or a session; the summary."""
        book = self.book
        if (request_id is None) == (session_id is None):
            raise CheckpointError("checkpoint: name exactly one of request_id and session_id")
        if request_id is not None:
            seq = in_flight(request_id)
            if not quiesce:
                raise CheckpointError(
                    f"quiesce: request {request_id!r} is still generating; pass quiesce to "
                    "pause it at a step boundary for the checkpoint"
                )
            tokens, computed = seq.all_ids, seq.num_computed
            prompt_len, params, seed, chat = len(seq.prompt_ids), seq.params, seq.seed, seq.chat
        else:
            session = self._sessions.get(session_id)
            if session is None:
                raise KeyError(f"session_id: {session_id!r} is not a session")
            tokens, computed = session.token_ids, len(session.token_ids) - 1  # last one unfed
            prompt_len, params, seed = session.prompt_len, session.sampling, session.seed
            chat = session.chat
        return book.create(
            capture(tokens, computed, prompt_len, params, seed, chat, position, self.grid)
        )

    def branch(
        self,
        checkpoint_id: str,
        sampling: SamplingParams | None,
        session_id: str | None,
        prompt: str | list[int] | None,
        encode: Callable[[str | list[int]], list[int]],
    ) -> Sequence:
        """The request continuing a checkpoint, after every reference was verified; `prompt`
        (encoded by `encode`) is a new turn after the checkpoint's tokens."""
        state = self.book.load(checkpoint_id)
        new_turn = encode(prompt) if prompt is not None else None
        return continuation(state, sampling, session_id, new_turn)

    def rewind(self, session_id: str, checkpoint_id: str) -> None:
        state = self.book.load(checkpoint_id)
        self._sessions[session_id] = Session(
            list(state.token_ids), state.prompt_len, state.sampling, state.seed, state.chat
        )

    def record_turn(self, seq: Sequence, text: str) -> None:
        """A finished turn of a session becomes the session's state."""
        if seq.session_id is None or seq.finish_reason == "abort":
            return
        chat = None if seq.chat is None else [*seq.chat, {"role": "assistant", "content": text}]
        self._sessions[seq.session_id] = Session(
            seq.all_ids, len(seq.prompt_ids), seq.params, seq.seed, chat
        )
