"""The requests in flight, by id, and the checks at the door.

A prompt is refused unless every id is in the vocabulary, and a request unless its prompt plus
`max_tokens` fits the context; a refusal raises ValueError naming the field and queues nothing.
"""

from __future__ import annotations

import itertools

import numpy as np

from flipjax.engine.scheduler import Scheduler
from flipjax.engine.sequence import Sequence
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

    def check_length(self, total: int) -> None:
        if total > self.max_model_len:
            raise ValueError(
                f"max_tokens: {total} tokens in all exceed the context {self.max_model_len}"
            )

    def enqueue(
        self, seq: Sequence, params: SamplingParams, max_new_tokens: int, request_id: str | None
    ) -> str:
        """Give `seq` its id and token budget and queue it; returns the id."""
        max_tokens = params.max_tokens if params.max_tokens is not None else max_new_tokens
        if max_tokens <= 0:
            name = "max_tokens" if params.max_tokens is not None else "max_new_tokens"
            raise ValueError(f"{name}: must be positive, got {max_tokens}")
        self.check_length(seq.num_tokens + max_tokens)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._live:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        seq.request_id, seq.max_tokens = request_id, seq.carried + max_tokens
        self.scheduler.add(seq)
        self._live[request_id] = seq
        return request_id

    def __getitem__(self, request_id: str) -> Sequence:
        seq = self._live.get(request_id)
        if seq is None:
            raise KeyError(f"request_id: {request_id!r} is not in flight")
        return seq

    def finish(self, seq: Sequence) -> None:
        """Free what `seq` holds and forget it."""
        self.scheduler.finish(seq)
        del self._live[seq.request_id]
