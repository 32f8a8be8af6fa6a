"""The trainer's n-gram baseline is a distribution: over the 256 next bytes its probabilities sum
to one after a seen context and after an unseen one, and text it has seen is cheap."""

from __future__ import annotations

import numpy as np
import pytest

from flipjax.train.ngram import ByteNgram


def _train(text: bytes) -> ByteNgram:
    return ByteNgram(np.frombuffer(text, np.uint8).astype(np.int64))


@pytest.mark.parametrize("context", [b"def", b"zq\x00"])
def test_the_next_byte_probabilities_sum_to_one(context):
    model = _train(b"def f(x):\n    return x\n" * 20 + b"class C:\n    pass\n")
    total = sum(
        2.0 ** -model.bits_per_byte(np.frombuffer(context + bytes([b]), np.uint8).astype(np.int64))
        for b in range(256)
    )
    assert total == pytest.approx(1.0, abs=1e-9)


def test_seen_text_costs_few_bits_and_unseen_text_many():
    model = _train(b"abcd" * 1000 + bytes(range(256)))
    seen = np.frombuffer(b"abcd" * 50, np.uint8).astype(np.int64)
    unseen = np.frombuffer(bytes(range(255, 55, -1)), np.uint8).astype(np.int64)
    assert model.bits_per_byte(seen) < 0.05
    assert model.bits_per_byte(unseen) > 6
