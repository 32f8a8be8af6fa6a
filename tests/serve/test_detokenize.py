"""Incremental detokenization: whole characters only, and nothing a stop string may take back."""

from __future__ import annotations

import random

import pytest

from flipjax.model.tokenizer import ByteTokenizer
from serve.detokenize import IncrementalText


def test_multibyte_characters_are_held_until_complete():
    text = IncrementalText(ByteTokenizer(), stop=[])
    ids = list("aé€".encode())  # 1 + 2 + 3 bytes
    released = [text.update([i]) for i in ids]
    assert released == ["a", "", "é", "", "", "€"]
    assert text.finish("aé€") == ""


def test_a_stop_string_spanning_tokens_is_never_streamed():
    text = IncrementalText(ByteTokenizer(), stop=["END"])
    ids = list(b"okEN")
    assert [text.update([i]) for i in ids] == ["", "", "o", "k"]
    # the next token completes "END": the engine finishes with the stop trimmed
    assert text.finish("ok") == ""
    assert text.sent == "ok"


def test_held_text_is_released_at_the_end():
    text = IncrementalText(ByteTokenizer(), stop=["STOP"])
    assert text.update(list(b"abcST")) == "ab"
    assert text.finish("abcST") == "cST"


def test_final_text_that_contradicts_the_stream_is_refused():
    text = IncrementalText(ByteTokenizer(), stop=[])
    text.update(list(b"abc"))
    with pytest.raises(RuntimeError, match="released 'abc'"):
        text.finish("abd")


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times():
    tokenizer = CountingTokenizer()
    text = IncrementalText(tokenizer, stop=["STOP"])
    words = "ascii, é, €, 😀 and more " * 100
    ids = list(words.encode())
    rng = random.Random(0)
    released, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        released.append(text.update(ids[i : i + n]))
        i += n
    released.append(text.finish(words))
    assert "".join(released) == words
    assert tokenizer.decoded <= 6 * len(ids), "decoding grew with the stream's length"
