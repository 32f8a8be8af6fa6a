"""The contiguous reference forward: every prompt position's logits in one program.

The paged engine is tested against this path (the tests' `support.internals.prompt_logits`). It runs
the whole model as one program, so it needs a single-stage layout (single or tp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.qwen3_next import forward, init_cache
from flipjax.runtime import multihost
from flipjax.runtime.binding import Binding
from flipjax.runtime.buckets import prefill_bucket


class ContiguousForward:
    def __init__(self, graphdef: nnx.GraphDef, cfg: ModelConfig, dtype: jnp.dtype):
        self.cfg = cfg
        self.dtype = dtype
        self._forward = jax.jit(
            functools.partial(forward, graphdef),
            static_argnames=("last_only",),
            donate_argnames=("cache",),
        )

    def __call__(self, binding: Binding, ids: list[int]) -> np.ndarray:
        """Logits for every position of `ids`, [len(ids), vocab] float32, from the parameters
        where `binding` placed them."""
        if multihost.current().multi:  # its programs are not announced to the other processes
            raise ValueError("prompt_logits: one process only; a cluster scores through steps")
        if len(binding.stages) > 1:
            raise ValueError(
                f"prompt_logits: runs the whole model in one program; flip from "
                f"{binding.placement.name} to a single-stage layout (single or tp) first"
            )
        width = prefill_bucket(len(ids))
        tokens = np.zeros((1, width), np.int32)
        positions = np.full((1, width), -1, np.int32)
        tokens[0, : len(ids)] = ids
        positions[0, : len(ids)] = np.arange(len(ids))
        cache = init_cache(self.cfg, 1, width, self.dtype)
        tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
        logits, _ = self._forward(binding.params, tokens, positions, cache)
        return np.asarray(logits[0, : len(ids)])
