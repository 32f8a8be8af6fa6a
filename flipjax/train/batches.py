"""Token batches: the corpus tokenized once into one stream (documents joined by EOS), cut into
sequences of a fixed length, and drawn in an order fixed by the seed and the epoch.

Where a run is in its data is two integers (`DataPosition`), saved with every checkpoint, so a
resumed run draws exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from flipjax.train.corpus import Document


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    index: int = 0  # sequences of this epoch already drawn


def token_stream(tokenizer: Tokenizer, docs: Sequence[Document], eos: int) -> np.ndarray:
    encodings = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    pieces = [np.asarray([*e.ids, eos], np.int32) for e in encodings]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


class Batches:
    """Sequences of `seq_len` tokens from `stream`, `batch` at a time."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch: int, seed: int):
        count = len(stream) // seq_len
        if count < batch:
            raise ValueError(
                f"corpus: {len(stream)} tokens make {count} sequences of --seq-len {seq_len}, "
                f"fewer than one --batch-size of {batch}"
            )
        self.sequences = stream[: count * seq_len].reshape(count, seq_len)
        self.batch = batch
        self.seed = seed

    @property
    def per_epoch(self) -> int:
        return len(self.sequences) // self.batch

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))

    def draw(self, at: DataPosition) -> tuple[np.ndarray, DataPosition]:
        """The batch at `at` ([batch, seq_len] int32) and the position after it."""
        if at.index + self.batch > len(self.sequences):
            at = DataPosition(at.epoch + 1, 0)
        rows = self._order(at.epoch)[at.index : at.index + self.batch]
        return self.sequences[rows], DataPosition(at.epoch, at.index + self.batch)


def eval_sequences(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """The first `count` whole sequences of the held-out stream ([n, seq_len])."""
    n = min(count, len(stream) // seq_len)
    return stream[: n * seq_len].reshape(n, seq_len)
