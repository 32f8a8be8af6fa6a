"""The offline engine: load a model, score prompts, generate greedily.

`Engine` is the entry point the other parts and outside checks use. This version runs a batch of
prompts over one contiguous cache (right-padded rows, padding marked by position -1). Shapes are
bucketed to powers of two so a mix of prompt lengths reuses a few compiled programs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.config import ModelConfig
from flipjax.model import Qwen3NextForCausalLM, forward, init_cache
from flipjax.tiny import TINY_NAME, tiny_model
from flipjax.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from flipjax.weights import load_params

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_MIN_BUCKET = 16


@dataclass
class Output:
    """One prompt's result. `token_ids` holds the generated ids only."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" when the model emitted its end-of-sequence token


def bucket(n: int) -> int:
    """Smallest power of two >= n (at least _MIN_BUCKET)."""
    return max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def parse_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


class Engine:
    def __init__(
        self, model: Qwen3NextForCausalLM, tokenizer: Tokenizer, name: str, dtype: jnp.dtype
    ):
        self.config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.name = name
        self.dtype = dtype
        self.graphdef, self.params = nnx.split(model)
        self._forward = jax.jit(
            functools.partial(forward, self.graphdef),
            static_argnames=("last_only",),
            donate_argnames=("cache",),
        )

    @classmethod
    def from_pretrained(cls, path: str, dtype: str | jnp.dtype = "float32") -> Engine:
        """`path` is a HF checkpoint folder, or "tiny" for the embedded untrained model."""
        jdtype = parse_dtype(dtype)
        if path == TINY_NAME:
            return cls(tiny_model(jdtype), ByteTokenizer(), TINY_NAME, jdtype)
        if not os.path.isdir(path):
            raise ValueError(f"model: {path!r} is neither a checkpoint folder nor {TINY_NAME!r}")
        cfg = ModelConfig.from_hf(path)
        abstract = nnx.eval_shape(lambda: Qwen3NextForCausalLM(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
        graphdef, abstract_state = nnx.split(abstract)
        params = load_params(path, cfg, abstract_state, jdtype)
        model = nnx.merge(graphdef, params)
        return cls(model, load_tokenizer(path, cfg.eos_token_id), os.path.basename(path), jdtype)

    # -- inputs ---------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: is empty")
        bad = [
            t
            for t in ids
            if not isinstance(t, (int, np.integer)) or not 0 <= t < self.config.vocab_size
        ]
        if bad:
            vocab = self.config.vocab_size
            raise ValueError(f"prompt: token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def _check_length(self, total: int) -> None:
        limit = self.config.max_position_embeddings
        if total > limit:
            raise ValueError(f"prompt: {total} tokens exceed max_position_embeddings {limit}")

    # -- scoring and generation -----------------------------------------------------------------

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits for every prompt position: [len(token_ids), vocab], float32."""
        ids = self.encode_prompt(token_ids)
        self._check_length(len(ids))
        tokens, positions = _right_pad([ids], bucket(len(ids)))
        cache = init_cache(self.config, 1, bucket(len(ids)), self.dtype)
        logits, _ = self._forward(self.params, tokens, positions, cache)
        return np.asarray(logits[0, : len(ids)])

    def generate(
        self, prompts: list[str] | list[list[int]], max_new_tokens: int = 16
    ) -> list[Output]:
        """Greedy generation for every prompt, batched over one cache."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be positive, got {max_new_tokens}")
        if not prompts:
            return []
        encoded = [self.encode_prompt(p) for p in prompts]
        longest = max(len(p) for p in encoded)
        self._check_length(longest + max_new_tokens)
        tokens, positions = _right_pad(encoded, bucket(longest))
        cache = init_cache(self.config, len(encoded), bucket(longest + max_new_tokens), self.dtype)
        logits, cache = self._forward(self.params, tokens, positions, cache, last_only=True)

        outputs = [Output(prompt_token_ids=p) for p in encoded]
        lengths = np.array([len(p) for p in encoded])
        running = np.ones(len(encoded), bool)
        eos = self.tokenizer.eos_token_id
        for step in range(max_new_tokens):
            next_ids = np.argmax(np.asarray(logits), axis=-1)
            for i in np.flatnonzero(running):
                outputs[i].token_ids.append(int(next_ids[i]))
                if eos is not None and next_ids[i] == eos:
                    outputs[i].finish_reason = "stop"
                    running[i] = False
            if step == max_new_tokens - 1 or not running.any():
                break
            # Finished rows get position -1 so their cache stays as it was.
            pos = np.where(running, lengths + step, -1)[:, None].astype(np.int32)
            logits, cache = self._forward(
                self.params,
                jnp.asarray(next_ids[:, None].astype(np.int32)),
                jnp.asarray(pos),
                cache,
                last_only=True,
            )
        for out in outputs:
            out.text = self.tokenizer.decode(out.token_ids)
        return outputs


def _right_pad(rows: list[list[int]], width: int) -> tuple[jax.Array, jax.Array]:
    tokens = np.zeros((len(rows), width), np.int32)
    positions = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
        positions[i, : len(row)] = np.arange(len(row))
    return jnp.asarray(tokens), jnp.asarray(positions)
