"""Sessions and checkpoints, as the engine sees them (the store depends on flipjax, never the
reverse; `store.checkpoints.CheckpointBook` is the implementation of the book).

A session is a conversation: the tokens of every turn so far, where the last turn's prompt
ended, that turn's sampling parameters and seed, and the chat messages of a chat session. A
checkpoint freezes that state at a position. Positions are snapped down to the GDN checkpoint
grid for what the store must hold (KV pages and the GDN anchor end there); the tokens between
the snapped and the requested position are recomputed on a branch, so the continuation is
exactly the one the original request would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from flipjax.sampling import SamplingParams


class CheckpointError(ValueError):
    """A checkpoint operation refused: its message names the reason."""


@dataclass
class Session:
    token_ids: list[int]
    prompt_len: int  # the last turn's prompt; the rest of token_ids it generated
    sampling: SamplingParams
    seed: int
    chat: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint holds, free of any layout."""

    token_ids: list[int]  # every token up to the requested position
    prompt_len: int
    position: int  # on the grid: the store holds pages and the GDN anchor up to here
    sampling: SamplingParams
    seed: int
    chat: list[dict[str, str]] | None = None


class CheckpointBook(Protocol):
    def create(self, state: CheckpointState) -> dict[str, Any]:
        """Write and pin a checkpoint; returns its summary (with `checkpoint_id`). Raises
        CheckpointError when the store lacks a page or the GDN anchor."""

    def load(self, checkpoint_id: str) -> CheckpointState:
        """A checkpoint whose every reference was just verified present; KeyError when
        unknown, CheckpointError naming the first missing reference."""

    def list(self) -> list[dict[str, Any]]: ...

    def delete(self, checkpoint_id: str) -> None:
        """Unpin what the checkpoint referenced; KeyError when unknown."""


def snap(requested: int, computed: int, grid: int) -> int:
    """The checkpoint position: `requested` snapped down to the grid, and never past the
    tokens whose state has been computed."""
    return min(requested, computed) // grid * grid
