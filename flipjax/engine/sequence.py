"""A request as the engine tracks it: its tokens, its pooled ids, and its progress.

`num_computed` counts the tokens already fed through the model (their KV is in the request's
pages, their effect in its GDN slot). The tokens still to feed are `all_ids[num_computed:]`:
more than one means prefill, exactly one means decode. A retracted request drops its pages and
slot and sets `num_computed` to 0, so it resumes by recomputing and loses no output.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from flipjax.runtime.constraint import TokenConstraint
from flipjax.runtime.sampling import SamplingParams
from store.prefix import Prefetch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    seed: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1...
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    draft_slots: list[int] = field(default_factory=list)  # a verify step's states (speculation)
    drafts: list[int] = field(default_factory=list)  # the MTP head's proposals after all_ids
    num_computed: int = 0
    cached_tokens: int = 0  # prompt tokens seeded from a prefix cache instead of computed
    carried: int = 0  # output_ids generated before this request (a branch of a checkpoint)
    session_id: str | None = None  # the session this turn extends when it finishes
    chat: list[dict[str, str]] | None = None  # the chat messages the prompt was rendered from
    grammar: TokenConstraint | None = None  # allowed tokens per step (structured output)
    cache_salt: str | None = None  # prefixes are shared only among requests with the same salt
    prefetch: Prefetch | None = None  # its stored prefix on the way to host memory
    # Parallel choices of one prompt (n > 1) waiting for this request's prompt to be computed,
    # then forked from it; a waiting choice knows its parent.
    forks: list[Sequence] = field(default_factory=list)
    parent: Sequence | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed, when its finish_reason is "error"
    text: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1
