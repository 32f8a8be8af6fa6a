"""Tokenizer files for the tests' transformers checkpoints."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def byte_tokenizer(path: str, specials: dict[int, str] | None = None) -> None:
    """A byte-level BPE without merges: one id per byte, 256 in all. `specials` puts special
    tokens at chosen ids; a byte whose id one of them takes moves to the next free id past 255."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    specials = specials or {}
    free = (i for i in range(len(alphabet), len(alphabet) + len(specials) + 1) if i not in specials)
    for token_id, content in specials.items():
        if token_id < len(alphabet):
            vocab[alphabet[token_id]] = next(free)
        vocab[content] = token_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    tok.save(path)
