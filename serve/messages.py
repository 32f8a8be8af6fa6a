"""What routes ask of the engine loop: one frozen dataclass per kind of request, applied by
`serve.dispatch` on the loop thread between two steps.

A route never hands the loop code to run: it says what it wants, and the dispatcher alone
decides how that touches the engine and the store. Each message names its answer's type; a
submitted request is answered with `Admitted`, then with an `Update` after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flipjax.engine.engine import Output
from flipjax.engine.sequence import TokenLogprob
from flipjax.runtime.constraint import TokenConstraint
from flipjax.runtime.sampling import DEFAULT_MAX_TOKENS, SamplingParams

# -- requests: queued by `EngineLoop.submit`, all or none --------------------------------------


@dataclass(frozen=True)
class NewRequest:
    """A prompt to generate from (`Engine.add_request`)."""

    prompt: str | list[int]
    sampling: SamplingParams | None = None
    max_new_tokens: int | None = DEFAULT_MAX_TOKENS
    session_id: str | None = None
    chat: list[dict[str, str]] | None = None
    n: int = 1
    grammar: TokenConstraint | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class Branch:
    """A request continuing from a session checkpoint (`Engine.branch`)."""

    checkpoint_id: str
    sampling: SamplingParams | None = None
    max_new_tokens: int = DEFAULT_MAX_TOKENS
    session_id: str | None = None
    prompt: str | list[int] | None = None


Start = NewRequest | Branch


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


@dataclass(frozen=True)
class Admitted:
    """One admitted request: its choices' ids, its prompt's size and the sampling it runs."""

    choices: tuple[str, ...]
    prompt_tokens: int
    sampling: SamplingParams


# -- commands and reads: run by `EngineLoop.call` ----------------------------------------------


@dataclass(frozen=True)
class Abort:
    """Stop a request in flight -> bool (False: no such request)."""

    request_id: str


@dataclass(frozen=True)
class Flip:
    """Reshard to `to` -> FlipRecord | None."""

    to: str
    reseed: bool = False


@dataclass(frozen=True)
class ReadStats:
    """The engine's stats snapshot -> EngineStats."""


@dataclass(frozen=True)
class ReadMemory:
    """The per-device memory ledger -> MemoryReport."""


@dataclass(frozen=True)
class ReadPhase:
    """The layout and the phase policy's state -> Phase."""


@dataclass(frozen=True)
class FlushCache:
    """Drop the device prefix cache -> {"pages": n, "states": n}."""


@dataclass(frozen=True)
class ReadSession:
    """A session's tokens and conversation -> Session | None."""

    session_id: str


@dataclass(frozen=True)
class Checkpoint:
    """Checkpoint a request or a session -> the checkpoint's summary."""

    request_id: str | None = None
    session_id: str | None = None
    position: int | None = None
    quiesce: bool = False


@dataclass(frozen=True)
class Rewind:
    session_id: str
    checkpoint_id: str


@dataclass(frozen=True)
class ListCheckpoints:
    """-> list of checkpoint summaries."""


@dataclass(frozen=True)
class DeleteCheckpoint:
    checkpoint_id: str


@dataclass(frozen=True)
class ShowStore:
    """The store's tiers, budgets and counters -> dict."""


@dataclass(frozen=True)
class AttachStore:
    """Attach a disk tier in `folder` (already checked against the store root) -> dict."""

    folder: str
    budget_bytes: int


@dataclass(frozen=True)
class DetachStore:
    """Detach the disk tier (queued writes land first; files stay) -> dict."""


@dataclass(frozen=True)
class ResizeStore:
    """Resize the disk tier; shrinking evicts at once -> dict."""

    budget_bytes: int


@dataclass(frozen=True)
class ClearStore:
    """Drop the stored prefixes, keeping what checkpoints pin -> counts per tier."""


Message = (
    Abort
    | Flip
    | ReadStats
    | ReadMemory
    | ReadPhase
    | FlushCache
    | ReadSession
    | Checkpoint
    | Rewind
    | ListCheckpoints
    | DeleteCheckpoint
    | ShowStore
    | AttachStore
    | DetachStore
    | ResizeStore
    | ClearStore
)
