"""Tokenizers: the checkpoint's own `tokenizer.json`, or the byte-level one of the tiny model.

Both expose the same three members, so nothing above this module knows which one it has.

A checkpoint's end-of-sequence token is the one its `config.json` names (transformers' `generate`
stops there); where it names none, the one transformers' tokenizer names, which lm-eval's
transformers backend stops at: a checkpoint whose model emits its tokenizer's `<|endoftext|>` ends
there, as it does in transformers, instead of generating on past it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer(Protocol):
    eos_token_id: int | None  # the end-of-sequence token (what is reported and documented)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a sequence: `eos_token_id` and the checkpoint's other EOS ids
        (`generation_config.json`'s list, as transformers' `generate` and vLLM stop on)."""
        ...

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
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(() if self.eos_token_id is None else (self.eos_token_id,))

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
        self.other_eos_ids: tuple[int, ...] = ()  # from generation_config.json

    @property
    def eos_token_ids(self) -> frozenset[int]:
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return frozenset((*first, *self.other_eos_ids))

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

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(() if self.eos_token_id is None else (self.eos_token_id,))

    def encode(self, text: str) -> list[int]:
        raise ValueError(f"prompt: {self.folder} has no tokenizer.json; pass token ids instead")

    def decode(self, token_ids: list[int]) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def load_tokenizer(folder: str, eos_token_id: int | None) -> Tokenizer:
    """`eos_token_id`: config.json's; without it, the EOS transformers' tokenizer names."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return MissingTokenizer(folder, eos_token_id)
    tokenizer = CheckpointTokenizer(path, eos_token_id)
    if eos_token_id is None and (name := named_eos(folder)) is not None:
        # A token the vocabulary lacks, transformers appends past it, where no model emits it.
        tokenizer.eos_token_id = tokenizer.backend.token_to_id(name)
    listed = generation_eos_ids(folder)
    if tokenizer.eos_token_id is None and listed:
        tokenizer.eos_token_id = listed[0]
    tokenizer.other_eos_ids = tuple(i for i in listed if i != tokenizer.eos_token_id)
    return tokenizer


def generation_eos_ids(folder: str) -> list[int]:
    """The EOS ids `config.json` and `generation_config.json` list (a Qwen3-Next instruct
    checkpoint lists both `<|endoftext|>` and `<|im_end|>`), in order, each once."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        listed = _json_object(folder, name).get("eos_token_id")
        listed = listed if isinstance(listed, list) else [] if listed is None else [listed]
        for token in listed:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                path = os.path.join(folder, name)
                raise ValueError(f"{path}: eos_token_id {token!r} is not a token id")
            if token not in ids:
                ids.append(token)
    return ids


# `AutoTokenizer` builds a qwen3_next checkpoint's tokenizer as this class unless its
# tokenizer_config.json names another; the class's EOS is its default.
QWEN2_TOKENIZERS = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
QWEN2_EOS = "<|endoftext|>"


def named_eos(folder: str) -> str | None:
    """The EOS token transformers' tokenizer has for the checkpoint in `folder`: the one that
    special_tokens_map.json, or else tokenizer_config.json, names (null: none), or else the
    default of its class."""
    config = _json_object(folder, "tokenizer_config.json")
    for name, entries in (
        ("special_tokens_map.json", _json_object(folder, "special_tokens_map.json")),
        ("tokenizer_config.json", config),
    ):
        if "eos_token" in entries:
            token = entries["eos_token"]
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None and not isinstance(token, str):
                raise ValueError(f"{os.path.join(folder, name)}: eos_token is not a token")
            return token
    return (
        QWEN2_EOS
        if config.get("tokenizer_class", QWEN2_TOKENIZERS[0]) in QWEN2_TOKENIZERS
        else None
    )


def _json_object(folder: str, name: str) -> dict[str, Any]:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        entries = json.load(f)
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: is not a JSON object")
    return entries
