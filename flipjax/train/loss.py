"""The training loss: next-token cross-entropy, plus the MTP head's cross-entropy on token t+2
with its own weight.

Both are means over the tokens that have a target. The forward is the one the engine serves
(`Qwen3NextForCausalLM.hidden_states` over a contiguous cache of the batch's length), traced
with the pure-JAX kernels: they are differentiable, the native CPU kernels are not.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flipjax.model.attention import ContiguousKV
from flipjax.model.qwen3_next import Qwen3NextForCausalLM, init_cache
from kernels_pallas import dispatch

# Differentiated, the chunked delta rule beats the per-token scan on the CPU too (a training
# step of the default model at 16 x 256 tokens: 4.8 s against 7.1 s).
DELTA_RULE_FORM = "chunked"


class Losses(NamedTuple):
    total: jax.Array  # what is minimised: next_token + mtp_weight * mtp
    next_token: jax.Array  # mean nats per predicted token
    mtp: jax.Array  # the MTP head's mean nats per token t+2 (0 without the head)
    tokens: jax.Array  # how many tokens next_token averages over


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Mean of -log softmax(logits)[target] over the entries with weight, in fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    return -jnp.sum(picked * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def hidden_states(
    model: Qwen3NextForCausalLM, tokens: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """The model's final hidden states [B, T, H] and, with the MTP head, the head's at each t
    but the last ([B, T-1, H]: from hidden t and token t+1, for token t+2), from scratch.
    Positions are -1 at padding; the head skips a t whose token t+1 is padding."""
    cfg = model.cfg
    b, t = tokens.shape
    dtype = model.model.embed_tokens.weight.dtype
    with dispatch.kernels("reference", prefill_form=DELTA_RULE_FORM):
        hidden, _ = model.hidden_states(tokens, positions, init_cache(cfg, b, t, dtype))
        if not hasattr(model, "mtp") or t < 3:
            return hidden, None
        mtp_positions = jnp.where(positions[:, 1:] >= 0, positions[:, :-1], -1)
        cache = ContiguousKV.empty(cfg, b, t - 1, dtype)
        mtp, _ = model.mtp_hidden_states(tokens[:, 1:], hidden[:, :-1], mtp_positions, cache)
    return hidden, mtp


def losses(
    model: Qwen3NextForCausalLM, tokens: jax.Array, mask: jax.Array, mtp_weight: float
) -> Losses:
    """tokens, mask: [B, T]; mask marks real tokens (padding at the end of a row is False)."""
    t = tokens.shape[1]
    positions = jnp.where(mask, jnp.arange(t, dtype=jnp.int32)[None, :], -1)
    hidden, mtp_hidden = hidden_states(model, tokens, positions)
    has_target = mask[:, 1:]
    next_token = cross_entropy(model.logits(hidden[:, :-1]), tokens[:, 1:], has_target)
    mtp = jnp.zeros((), jnp.float32)
    if mtp_hidden is not None:
        mtp = cross_entropy(model.logits(mtp_hidden[:, :-1]), tokens[:, 2:], mask[:, 2:])
    total = next_token + mtp_weight * mtp
    return Losses(total, next_token, mtp, jnp.sum(has_target))
