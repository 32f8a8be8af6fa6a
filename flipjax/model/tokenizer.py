"""Tokenizers: the checkpoint's own `tokenizer.json`, or the byte-level one of the tiny model.

Both expose the same three members, so nothing above this module knows which one it has.
"""

from __future__ import annotations

import os
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte of a longer character on its own)."""


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens follow. Ids past those decode to nothing."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.eos_token_id: int | None = 256

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        special = token_id - 256
        return self.SPECIALS[special].encode() if special < len(self.SPECIALS) else b""


class CheckpointTokenizer:
    """Wraps a HF fast tokenizer file (`tokenizer.json`)."""

    def __init__(self, path: str, eos_token_id: int | None):
        self._tok = HFTokenizer.from_file(path)
        self.eos_token_id = eos_token_id

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object itself (what grammar engines build their vocabulary from)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


class MissingTokenizer:
    """A checkpoint without `tokenizer.json` serves token ids only; text is refused by name."""

    def __init__(self, folder: str, eos_token_id: int | None):
        self.folder = folder
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        raise ValueError(f"prompt: {self.folder} has no tokenizer.json; pass token ids instead")

    def decode(self, token_ids: list[int]) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def load_tokenizer(folder: str, eos_token_id: int | None) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path):
        return CheckpointTokenizer(path, eos_token_id)
    return MissingTokenizer(folder, eos_token_id)
