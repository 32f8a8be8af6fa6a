"""Incremental detokenization: whole characters only, and nothing a stop string may take back."""

from __future__ import annotations

import pytest

from flipjax.tokenizer import ByteTokenizer
from serve.detokenize import IncrementalText


def test_multibyte_characters_are_held_until_complete():
    text = IncrementalText(ByteTokenizer(), stop=[])
    ids = list("aé€".encode())  # 1 + 2 + 3 bytes
    released = [text.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert released == ["a", "", "é", "", "", "€"]
    assert text.finish("aé€") == ""


def test_a_stop_string_spanning_tokens_is_never_streamed():
    text = IncrementalText(ByteTokenizer(), stop=["END"])
    ids = list(b"okEN")
    assert [text.update(ids[:n]) for n in range(1, 5)] == ["", "", "o", "k"]
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
