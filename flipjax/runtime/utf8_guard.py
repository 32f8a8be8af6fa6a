"""Keeps constrained output valid UTF-8, whatever the grammar's byte ranges admit.

xgrammar matches characters byte by byte, and some of its character classes admit sequences
that are not UTF-8: a JSON string's characters admit surrogates (ED A0..BF xx), a pattern's
`.`, `[^...]`, `\\S`, `\\W` or `\\D` also overlong forms (E0 80..9F xx, F0 80..8F xx xx). Text
with them does not decode, and decoded with replacement characters it breaks lengths and
patterns. The guard narrows each mask to the tokens that keep the text valid UTF-8 (RFC 3629)
from where it stands: one of eight states, how many continuation bytes the last character
still needs and in which range the next one must lie. It reads only the vocabulary's bytes.
"""

from __future__ import annotations

import numpy as np

from flipjax.runtime.sampler import bitmask_words

# (continuation bytes still needed, lowest and highest byte allowed next); state 0: none.
STATES = (
    (0, 0, 0),
    (1, 0x80, 0xBF),
    (2, 0x80, 0xBF),
    (3, 0x80, 0xBF),
    (2, 0xA0, 0xBF),  # after E0: no overlong three-byte form
    (2, 0x80, 0x9F),  # after ED: no surrogate
    (3, 0x90, 0xBF),  # after F0: no overlong four-byte form
    (3, 0x80, 0x8F),  # after F4: nothing past U+10FFFF
)
_INDEX = {s: i for i, s in enumerate(STATES)}
_LEADS = {0xE0: 4, 0xED: 5, 0xF0: 6, 0xF4: 7}


def _lead(byte: int) -> int | None:
    """The state after a lead byte; 0 for ASCII; None for a byte no character starts with."""
    if byte < 0x80:
        return 0
    if byte in _LEADS:
        return _LEADS[byte]
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE1 <= byte <= 0xEF:
        return 2
    return 3 if 0xF1 <= byte <= 0xF3 else None


def run(state: int, data: bytes) -> int | None:
    """The state after `data` from `state`, or None where `data` breaks UTF-8."""
    for byte in data:
        need, lo, hi = STATES[state]
        if need == 0:
            nxt = _lead(byte)
            if nxt is None:
                return None
            state = nxt
        elif lo <= byte <= hi:
            state = _INDEX[(need - 1, 0x80, 0xBF)] if need > 1 else 0
        else:
            return None
    return state


def _whole(data: bytes) -> bool:
    """`data` is whole characters of valid UTF-8 (Python's decoder refuses surrogates and
    overlong forms too)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def pack(allowed: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab] bool -> [ceil(vocab / 32)] int32 bitmask (bit t % 32 of word t // 32)."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, bool)
    bits[:vocab_size] = allowed[:vocab_size]
    return np.packbits(bits, bitorder="little").view(np.int32)


class Utf8Guard:
    def __init__(self, vocab: list[bytes], vocab_size: int):
        """`vocab`: each token id's bytes (xgrammar's decoded vocabulary)."""
        vocab = list(vocab[:vocab_size]) + [b""] * max(vocab_size - len(vocab), 0)
        # [state, token] -> the state after the token, -1 where it breaks UTF-8.
        self.after = np.full((len(STATES), vocab_size), -1, np.int8)
        for token, data in enumerate(vocab):
            if _whole(data):  # the common case, quickly: from state 0 only, back to it
                self.after[0, token] = 0
                continue
            for state in range(len(STATES)):
                end = run(state, data)
                self.after[state, token] = -1 if end is None else end
        self.masks = [pack(self.after[s] >= 0, vocab_size) for s in range(len(STATES))]

    def narrow(self, mask: np.ndarray, state: int) -> np.ndarray:
        """`mask` without the tokens that would break UTF-8 from `state`."""
        return mask & self.masks[state]

    def advance(self, state: int, token: int) -> int:
        if token >= self.after.shape[1]:
            return state
        return max(int(self.after[state, token]), 0)
