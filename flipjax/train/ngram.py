"""The baseline a trained model's bits per byte are read against: an order-4 byte n-gram model
with Witten-Bell interpolation, fitted on the training documents and scored on the held-out
ones of the same corpus split (`python -m flipjax.train.ngram [--data ...]`).

Witten-Bell: P(b | h) = (c(h, b) + T(h) P(b | h')) / (c(h) + T(h)), with T(h) the distinct bytes
seen after h and h' the context one byte shorter, down to the uniform 1/256. Counting is by
sorted integer keys (context bytes and the next byte packed into one int64), so the whole
standard library fits in a few seconds of numpy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from flipjax.train import corpus

ORDER = 4


def bytes_of(docs: Sequence[corpus.Document]) -> np.ndarray:
    return np.frombuffer(b"\n".join(d.text.encode() for d in docs), np.uint8).astype(np.int64)


def _keys(data: np.ndarray, context: int) -> np.ndarray:
    """For each position from `context` on: its `context` preceding bytes and itself, packed."""
    key = np.zeros(len(data) - context, np.int64)
    for j in range(context + 1):
        key = (key << 8) | data[j : len(data) - context + j]
    return key


class ByteNgram:
    def __init__(self, train: np.ndarray, order: int = ORDER):
        if len(train) <= order:
            raise ValueError(f"ngram: {len(train)} training bytes are too few for order {order}")
        self.order = order
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted key, count) per context
        self.contexts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # key, count, types
        for context in range(1, order):
            pair, pair_count = np.unique(_keys(train, context), return_counts=True)
            ctx, first = np.unique(pair >> 8, return_index=True)
            ctx_count = np.add.reduceat(pair_count, first)
            types = np.diff(np.append(first, len(pair)))
            self.pairs.append((pair, pair_count))
            self.contexts.append((ctx, ctx_count, types))
        self.unigram = (np.bincount(train, minlength=256) + 1) / (len(train) + 256)

    def bits_per_byte(self, data: np.ndarray) -> float:
        """Mean -log2 P(byte | the up to order-1 bytes before it) over `data` past its start."""
        start = self.order - 1
        probs = self.unigram[data[start:]]
        for context in range(1, self.order):
            keys = _keys(data, context)[start - context :]
            pair, pair_count = self.pairs[context - 1]
            ctx, ctx_count, types = self.contexts[context - 1]
            c_pair = _lookup(pair, pair_count, keys)
            at = np.clip(np.searchsorted(ctx, keys >> 8), 0, len(ctx) - 1)
            seen = ctx[at] == (keys >> 8)
            c_ctx = np.where(seen, ctx_count[at], 0)
            t_ctx = np.where(seen, types[at], 0)
            mixed = (c_pair + t_ctx * probs) / np.maximum(c_ctx + t_ctx, 1)
            probs = np.where(seen, mixed, probs)
        return float(-np.log2(probs).mean())


def _lookup(keys: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    at = np.clip(np.searchsorted(keys, wanted), 0, len(keys) - 1)
    return np.where(keys[at] == wanted, counts[at], 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flipjax.train.ngram", description=__doc__)
    parser.add_argument("--data", action="append", help="as `python -m flipjax.train --data`")
    parser.add_argument("--order", type=int, default=ORDER)
    args = parser.parse_args(argv)
    texts = corpus.load(args.data or [corpus.STDLIB])
    model = ByteNgram(bytes_of(texts.train), args.order)
    held_out = bytes_of(texts.held_out)
    print(
        f"order-{args.order} byte n-gram (Witten-Bell): {model.bits_per_byte(held_out):.4f} "
        f"bits/byte on {len(held_out):,} held-out bytes",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
