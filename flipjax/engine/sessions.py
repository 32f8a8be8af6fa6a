"""Sessions and checkpoints, as the engine sees them; `store.checkpoints.CheckpointBook` keeps
the checkpoints.

A session is a conversation: the tokens of every turn so far, where the last turn's prompt
ended, that turn's sampling parameters and seed, and the chat messages of a chat session. A
checkpoint freezes that state at a position. Positions are snapped down to the GDN checkpoint
grid for what the store must hold (KV pages and the GDN anchor end there); the tokens between
the snapped and the requested position are recomputed on a branch, so the continuation is
exactly the one the original request would have produced.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from flipjax.engine.sequence import Sequence
from flipjax.runtime.sampling import SamplingParams
from store.checkpoints import CheckpointError, CheckpointState


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
        "", state.token_ids[: state.prompt_len], params, 0, seed,
        output_ids=state.token_ids[state.prompt_len :], session_id=session_id, chat=state.chat,
    )  # fmt: skip
    seq.carried = len(seq.output_ids)
    return seq
