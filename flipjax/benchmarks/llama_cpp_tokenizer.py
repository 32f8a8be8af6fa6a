"""The tokenizer llama.cpp's converter is given for the engine benchmark's checkpoints.

The converter names a BPE tokenizer's pre-tokenizer by the hash of its token ids on a fixed
text, and refuses one it does not know; the bench's random checkpoints have no tokenizer at all.
DeepSeek-Coder's byte-level BPE (32,256 ids) is rebuilt here from the vocabulary file llama.cpp
ships for its own tokenizer tests, and checked against the token ids of that file's test cases
before use, so the converter recognises it as the tokenizer it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

TOKENIZER_VOCAB = "models/ggml-vocab-deepseek-coder.gguf"
TOKENIZER_SIZE = 32256
BOS = "<｜begin▁of▁sentence｜>"


def write_tokenizer(folder: Path, source: Path) -> None:
    """Write DeepSeek-Coder's tokenizer (rebuilt from llama.cpp's vocabulary file under
    `source`) into `folder`, as transformers saves it; RuntimeError if the rebuilt tokenizer
    does not give the token ids of that file's own test cases."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(source / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.remove(str(source / "gguf-py"))
    vocab_file = source / TOKENIZER_VOCAB
    fields = gguf.GGUFReader(vocab_file).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    kinds = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    # The BPE vocabulary: the normal tokens, and the byte symbols of the 13 bytes valid UTF-8
    # never holds, which the original tokenizer carries as added tokens right after them (as
    # added tokens, llama.cpp's converter would decode each to the same replacement character).
    bpe_vocab = {
        t: i
        for i, t in enumerate(tokens)
        if kinds[i] == gguf.TokenType.NORMAL
        or (len(t) == 1 and kinds[i] == gguf.TokenType.USER_DEFINED)
    }
    tokenizer = Tokenizer(models.BPE(vocab=bpe_vocab, merges=merges))
    # DeepSeek-Coder's pre-tokenizer: the splits llama.cpp names for it, then bytes.
    split = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+"]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), "isolated") for r in split]
        + [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # The special tokens after them, in id order; the converter pads the ids past the last.
    added = [
        (i, t) for i, t in enumerate(tokens) if t not in bpe_vocab and not t.startswith("[PAD")
    ]
    tokenizer.add_tokens(
        [
            AddedToken(t, special=kinds[i] == gguf.TokenType.CONTROL, normalized=False)
            for i, t in added
        ]
    )
    if any(tokenizer.token_to_id(t) != i for i, t in added):
        raise RuntimeError("the rebuilt tokenizer does not keep llama.cpp's ids for its specials")
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokens.index(BOS))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS)
    cases = (
        vocab_file.with_name(vocab_file.name + ".inp").read_text().split("\n__ggml_vocab_test__\n")
    )
    wanted = vocab_file.with_name(vocab_file.name + ".out").read_text().split("\n")
    for text, ids in zip(cases, wanted, strict=False):
        if fast.encode(text, add_special_tokens=False) != [int(i) for i in ids.split()]:
            raise RuntimeError(f"the rebuilt tokenizer differs from llama.cpp's on {text[:40]!r}")
    fast.save_pretrained(folder)
