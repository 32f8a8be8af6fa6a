"""A speculative verify step's GDN cache: the state after every position, each in a slot.

A verify step feeds a row its pending token and its draft tokens at once, [B, T], and which of
them are accepted is known only after it. So it keeps the recurrent and conv state after each
position t in slot `chain[b, t]` (slots the request holds for that), and committing an accepted
run is then a copy of one of them, never a recomputation. Each position runs the one-token
update a plain decode step runs (the native pooled kernel, given the whole chain, or the
reference rule), so the state kept after position t is the one a plain decode of the same
tokens would have reached.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flipjax.model.gated_deltanet import Columns, causal_conv
from kernels_pallas import dispatch


class ChainedGDN(NamedTuple):
    """A GDN layer's cache in a verify step: its pool of recurrent states, the slot each row
    starts from, the slot each position's state goes to, and the rows' conv states.

    pool: [S, Hv, dk, dv]; reads: [B] (out of range: a zero state); chain: [B, T] (out of
    range: dropped, as for a padding position); conv: [B, K-1, conv_dim].
    """

    pool: jax.Array
    reads: jax.Array
    chain: jax.Array
    conv: jax.Array

    def advance(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """o [B, T, Hv, dv] and, where the native kernel runs, the pool with every position's
        state in its chain slot; otherwise the states after every position, [B, T, ...]."""
        native = dispatch.pooled_delta_rule(k.shape[2], v.shape[2])
        if native is not None:  # the decode kernel, through the row's tokens in one call
            return native(self.pool, self.reads, self.chain, q, k, v, g, beta, valid)
        steps = [
            tuple(a[:, i : i + 1] for a in (q, k, v, g, beta, valid)) for i in range(q.shape[1])
        ]
        outs = []
        rule = dispatch.delta_rule(1)
        state = jnp.take(self.pool, self.reads, axis=0, mode="fill", fill_value=0)
        states = []
        for step in steps:
            o, state = rule(*step[:5], state, step[5])
            outs.append(o)
            states.append(state)
        return jnp.concatenate(outs, axis=1), jnp.stack(states, axis=1)

    def convolve(
        self, x: jax.Array, weight: jax.Array, valid: jax.Array, source: Columns | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """y as a plain step computes it, and the conv state after every position [B, T, K-1,
        C]: the last K-1 inputs up to it."""
        y, _ = causal_conv(x, weight, self.conv, valid)
        window = self.conv.shape[1]
        inputs = jnp.concatenate([self.conv.astype(x.dtype), x], axis=1)
        states = [inputs[:, i + 1 : i + 1 + window] for i in range(x.shape[1])]
        return y, jnp.stack(states, axis=1).astype(self.conv.dtype)
