"""A byte-level BPE tokenizer trained on the corpus with the `tokenizers` library, written as the
`tokenizer.json` and `tokenizer_config.json` (with a ChatML chat template) of a checkpoint.

Byte-level: every byte string has a tokenization, and each vocabulary entry spells its bytes one
character per byte, which is how bits per byte are counted (`token_byte_lengths`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
CONFIG_FILE = "tokenizer_config.json"
SPECIALS = (EOS, "<|im_start|>", "<|im_end|>")
MIN_VOCAB, MAX_VOCAB = 512, 65536
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A BPE tokenizer of `vocab_size` entries (specials first, ids 0..2) over `texts`."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"--vocab-size: must be in [{MIN_VOCAB}, {MAX_VOCAB}], got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def eos_id(tokenizer: Tokenizer) -> int:
    token = tokenizer.token_to_id(EOS)
    if token is None:
        raise ValueError(f"tokenizer: has no {EOS} token")
    return token


def token_byte_lengths(tokenizer: Tokenizer) -> list[int]:
    """The bytes each id stands for (0 for the specials), indexed by id."""
    lengths = [0] * tokenizer.get_vocab_size()
    specials = set(SPECIALS)
    for token, i in tokenizer.get_vocab().items():
        lengths[i] = 0 if token in specials else len(token)  # one character per byte
    return lengths


def save(tokenizer: Tokenizer, folder: str) -> None:
    """`tokenizer.json`, and `tokenizer_config.json` naming the EOS and the chat template."""
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)
