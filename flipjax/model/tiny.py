"""The embedded default model `tiny`: a seeded, untrained hybrid Qwen3-Next and its tokenizer.

It exists so that every command and test runs with no download. Its outputs are deterministic
nonsense; say so wherever it is served.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.model import tiny_cache
from flipjax.model.config import ModelConfig, interleaved_layer_types
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.tokenizer import ByteTokenizer

TINY_NAME = "tiny"
TINY_SEED = 0
TINY_DESCRIPTION = "flipjax tiny: untrained, seeded random weights (outputs are meaningless)"


def tiny_config() -> ModelConfig:
    n_layers = 8
    return ModelConfig(
        vocab_size=320,  # 256 bytes + specials, padded to a multiple of 64
        hidden_size=256,
        num_hidden_layers=n_layers,
        layer_types=interleaved_layer_types(n_layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        decoder_sparse_step=2,  # layers 1, 3, 5, 7 are MoE, the rest dense
        max_position_embeddings=4096,
        eos_token_id=ByteTokenizer().eos_token_id,
    )


def tiny_model(dtype: jnp.dtype) -> Qwen3NextForCausalLM:
    """A fresh `tiny` module with arrays of its own, copied from the process's host copy of
    the seeded weights (so no device holds weights that no module uses)."""
    graphdef, treedef, leaves = _tiny_weights(jnp.dtype(dtype).name)
    arrays = [jnp.asarray(x) for x in leaves]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, arrays))


@functools.lru_cache(maxsize=2)
def _tiny_weights(dtype: str) -> tuple[nnx.GraphDef, Any, tuple[np.ndarray, ...]]:
    """The seeded weights on the host, made once per process and dtype (and kept on disk from
    one process to the next: `tiny_cache`); every engine, server and test that asks for `tiny`
    would otherwise pay the initializers' dispatches."""
    shapes = nnx.eval_shape(lambda: _seeded_module(dtype))
    graphdef, state = nnx.split(shapes)
    abstract, treedef = jax.tree_util.tree_flatten(state)
    leaves = tiny_cache.cached_leaves(dtype, TINY_SEED, abstract, lambda: _make_leaves(dtype))
    return graphdef, treedef, tuple(leaves)


def _seeded_module(dtype: str) -> Qwen3NextForCausalLM:
    return Qwen3NextForCausalLM(tiny_config(), dtype=jnp.dtype(dtype), rngs=nnx.Rngs(TINY_SEED))


def _make_leaves(dtype: str) -> list[np.ndarray]:
    leaves = jax.tree_util.tree_leaves(nnx.state(_seeded_module(dtype)))
    # Norm weights start at 0 (or 1); perturb every parameter so a norm bug cannot hide.
    keys = jax.random.split(jax.random.PRNGKey(TINY_SEED + 1), len(leaves))
    leaves = [
        (x + 0.05 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    # Copied out: on the CPU `np.asarray` is a view that keeps the device buffer alive.
    return [np.array(x, copy=True) for x in leaves]
