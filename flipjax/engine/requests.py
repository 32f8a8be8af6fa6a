"""The requests in flight, by id, and the checks at the door.

A prompt is refused unless every id is in the vocabulary, and a request unless its prompt plus
`max_tokens` fits the context; a refusal raises ValueError naming the field and queues nothing.
"""

from __future__ import annotations

import itertools

import numpy as np

from flipjax.engine.scheduler import Scheduler
from flipjax.engine.sequence import Sequence, TokenLogprob
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime.sampling import SamplingParams


class Requests:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, scheduler: Scheduler
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self._live: dict[str, Sequence] = {}
        self._choices: dict[str, list[str]] = {}
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def check_vocabulary(self, params: SamplingParams) -> None:
        """Every id and count a request names is within the vocabulary: the sampler indexes
        and sorts by them, so an id past the end must be refused, never wrapped around."""
        vocab = self.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:8]} are outside the vocabulary")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids: token ids {bad[:8]} are outside the vocabulary [0, {vocab})"
            )
        if params.top_k > vocab:
            raise ValueError(
                f"top_k: must be in [-1, {vocab}] (the vocabulary), got {params.top_k}"
            )

    def check_length(self, total: int) -> None:
        if total > self.max_model_len:
            raise ValueError(
                f"max_tokens: {total} tokens in all exceed the context {self.max_model_len}"
            )

    def enqueue(
        self,
        seq: Sequence,
        params: SamplingParams,
        max_new_tokens: int | None,
        request_id: str | None,
        n: int = 1,
    ) -> str:
        """Give `seq` its id and token budget and queue it, with `n - 1` more choices that fork
        from it once its prompt is computed (ids `<id>-1`, ...); returns the id."""
        if n < 1 or (n > 1 and seq.session_id is not None):
            raise ValueError(f"n: {n} choices; a request has at least one, a session turn one")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_new_tokens
        if max_tokens is None:  # as many as the context and the page pool leave room for
            pool = self.scheduler.pages.total * self.scheduler.page_size
            max_tokens = max(min(self.max_model_len, pool) - seq.num_tokens, 1)
        if max_tokens < 0 or (max_tokens == 0 and params.prompt_logprobs is None):
            name = "max_tokens" if params.max_tokens is not None else "max_new_tokens"
            raise ValueError(f"{name}: must be positive, got {max_tokens}")
        self.check_vocabulary(params)
        self.check_length(seq.num_tokens + max_tokens)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._live:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        seq.request_id, seq.max_tokens = request_id, seq.carried + max_tokens
        seq.forks = [_choice(seq, i) for i in range(1, n)]
        self.scheduler.add(seq)
        for s in (seq, *seq.forks):
            self._live[s.request_id] = s
        self._choices[request_id] = [s.request_id for s in (seq, *seq.forks)]
        return request_id

    def generated(self, request_id: str, start: int = 0) -> tuple[list[int], list[TokenLogprob]]:
        """The ids an in-flight request generated from index `start` on (what is new), and
        their logprobs when it asked for them."""
        seq = self[request_id]
        return seq.output_ids[seq.carried + start :], seq.logprobs[start:]

    def prompt_tokens(self, request_id: str) -> int:
        seq = self[request_id]
        return len(seq.prompt_ids) + seq.carried

    def choices(self, request_id: str) -> list[str]:
        """The ids of a request's parallel choices, itself first (one unless it asked n)."""
        self[request_id]
        return list(self._choices.get(request_id, [request_id]))

    def ids(self) -> list[str]:
        """Every request in flight, choices included."""
        return list(self._live)

    def __getitem__(self, request_id: str) -> Sequence:
        seq = self._live.get(request_id)
        if seq is None:
            raise KeyError(f"request_id: {request_id!r} is not in flight")
        return seq

    def finish(self, seq: Sequence) -> None:
        """Free what `seq` holds and forget it."""
        self.scheduler.finish(seq)
        del self._live[seq.request_id]
        self._choices.pop(seq.request_id, None)


MAX_CACHE_SALT_CHARS = 1024  # a tenant id or a hash of one, with room to spare


def check_salt(salt: str | None) -> None:
    """Refuse a cache salt that is not a non-empty, bounded string."""
    if salt is None:
        return
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
        raise ValueError(
            f"cache_salt: must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
            f"characters, got {got}"
        )


def _choice(parent: Sequence, i: int) -> Sequence:
    """Choice `i` of `parent`'s prompt: the same request with its own id, RNG stream (seed + i,
    as vLLM seeds parallel choices) and grammar state."""
    grammar = parent.grammar.fork() if parent.grammar is not None else None
    return Sequence(
        f"{parent.request_id}-{i}",
        parent.prompt_ids,
        parent.params,
        parent.max_tokens,
        parent.seed + i,
        chat=parent.chat,
        grammar=grammar,
        cache_salt=parent.cache_salt,
        parent=parent,
    )
