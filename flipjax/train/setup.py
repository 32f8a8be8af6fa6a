"""Everything a run needs before its first step, each checked with its problem named: the
corpus, the tokenizer (trained, or the run's or the checkpoint's own), the model config and
its parameters (fresh, or a checkpoint's for fine-tuning)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from flipjax.model.config import ModelConfig
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.weights import load_params, tensor_files
from flipjax.train import bpe, corpus, shape
from flipjax.train.batches import token_stream

TOKENIZER_FILE = "tokenizer.json"


@dataclass
class Prepared:
    tokenizer: Tokenizer
    train_stream: np.ndarray
    held_out_stream: np.ndarray
    cfg: ModelConfig
    model: Qwen3NextForCausalLM
    skipped: int  # corpus files that are not UTF-8


def prepare(out: str, values: dict[str, Any]) -> Prepared:
    texts = corpus.load(values["data"])
    tokenizer = _tokenizer(out, values, texts)
    eos = bpe.eos_id(tokenizer)
    vocab = tokenizer.get_vocab_size()
    if values["config"] is not None:
        base = ModelConfig.from_hf(values["config"])
    elif values["init"] is not None:
        base = ModelConfig.from_hf(values["init"])
        if base.mtp_num_hidden_layers == 0:  # a checkpoint without the head: train a new one
            base = dataclasses.replace(base, mtp_num_hidden_layers=1)
    else:
        base = shape.default_config(vocab, eos)
    cfg = shape.fitted(base, vocab, eos, values["seq_len"])
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(values["seed"]), mtp=True)
    if values["init"] is not None:
        load_into(model, values["init"], cfg)
    return Prepared(
        tokenizer=tokenizer,
        train_stream=token_stream(tokenizer, texts.train, eos),
        held_out_stream=token_stream(tokenizer, texts.held_out, eos),
        cfg=cfg,
        model=model,
        skipped=len(texts.skipped),
    )


def _tokenizer(out: str, values: dict[str, Any], texts: corpus.Corpus) -> Tokenizer:
    """The run's own (saved when it started), the fine-tuned checkpoint's, or one trained now
    on the training documents and saved in the run's folder."""
    own = os.path.join(out, TOKENIZER_FILE)
    if os.path.isfile(own):
        return Tokenizer.from_file(own)
    if values["init"] is None:
        tokenizer = bpe.train((d.text for d in texts.train), values["vocab_size"])
        bpe.save(tokenizer, out)
        return tokenizer
    path = os.path.join(values["init"], TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--init: {values['init']} has no {TOKENIZER_FILE} to train with")
    tokenizer = Tokenizer.from_file(path)
    if tokenizer.token_to_id(bpe.EOS) is None:
        raise ValueError(f"--init: {path} has no {bpe.EOS} token")
    for name in (TOKENIZER_FILE, bpe.CONFIG_FILE):  # the checkpoint's own, chat template and all
        source = os.path.join(values["init"], name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(out, name))
    return tokenizer


def load_into(model: Qwen3NextForCausalLM, folder: str, cfg: ModelConfig) -> None:
    """The checkpoint's parameters into `model`; a checkpoint without `mtp.*` tensors keeps the
    fresh head."""
    with_head = _has_mtp(folder)
    abstract_model = nnx.eval_shape(
        lambda: Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), mtp=with_head)
    )
    _, abstract = nnx.split(abstract_model, nnx.Param)
    loaded = load_params(folder, cfg, abstract, jnp.float32)
    nnx.update(model, loaded)


def _has_mtp(folder: str) -> bool:
    return any(name.startswith("mtp.") for name in tensor_files(folder))
