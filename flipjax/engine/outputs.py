"""What the engine hands back: a finished request's `Output`, and what the last step did.

A finished request's text is the decode of everything it generated, except that a stop string
already cut it (`flipjax.engine.stopping`); a branch of a checkpoint answers with what it
generated itself, not with the tokens it carried from the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flipjax.engine.sequence import Sequence, TokenLogprob
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime.sampling import SamplingParams


@dataclass
class Output:
    """One request's result. `token_ids` holds the generated ids only."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length", "abort" or "error" (then `error` says why)
    logprobs: list[TokenLogprob] | None
    ttft_s: float | None  # arrival to first token
    e2e_s: float  # arrival to finish
    cached_tokens: int = 0  # prompt tokens taken from the prefix store, not computed
    # With prompt logprobs: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # a fault in this request's own work: it failed, the others not


@dataclass(frozen=True)
class StepStats:
    """What the last step did, for throughput measurement (sampling syncs, so `seconds` is
    the step's real time)."""

    layout: str
    prefill_tokens: int
    decode_rows: int
    seconds: float


def final_text(seq: Sequence, tokenizer: Tokenizer) -> str:
    """The text `seq` answers with, once it has finished."""
    if not seq.params.stop or seq.finish_reason != "stop":
        seq.text = tokenizer.decode(seq.output_ids)
    if not seq.carried:
        return seq.text
    before = tokenizer.decode(seq.output_ids[: seq.carried])
    return seq.text[len(before) :] if seq.text.startswith(before) else ""


def build_output(seq: Sequence, text: str) -> Output:
    seq.finish_time = time.perf_counter()
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    return Output(
        request_id=seq.request_id,
        prompt_token_ids=seq.all_ids[: len(seq.prompt_ids) + seq.carried],
        token_ids=seq.output_ids[seq.carried :],
        text=text,
        finish_reason=seq.finish_reason or "abort",
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        ttft_s=ttft,
        e2e_s=seq.finish_time - seq.arrival_time,
        cached_tokens=seq.cached_tokens,
        prompt_logprobs=prompt_logprobs(seq),
        error=seq.error,
    )


def prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
    """One per prompt token, None for the first; None when the request did not ask."""
    return None if seq.params.prompt_logprobs is None else [None, *seq.prompt_logprobs]


@dataclass(frozen=True)
class Progress:
    """Where a request in flight stands: what it generated from some index on, and what a
    streaming client needs with its first tokens."""

    request_id: str
    new_ids: list[int]  # generated from the index asked for on
    new_logprobs: list[TokenLogprob]  # theirs, when the request asked for logprobs
    choices: tuple[str, ...]  # its parallel choices' ids, itself first
    prompt_tokens: int
    sampling: SamplingParams
    # With prompt logprobs, and only when asked from index 0: one per prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
