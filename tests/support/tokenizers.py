"""Tokenizer files for the tests' transformers checkpoints."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def byte_tokenizer(path: str) -> None:
    """A byte-level BPE without merges: 256 ids, one per byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(path)
