"""The compiled training and evaluation steps, data-parallel over a mesh's devices.

Parameters and optimizer state are replicated; each batch is split over the mesh's `data` axis
(`NamedSharding`), so XLA's partitioner reduces the gradients across devices. One device is the
same program on a mesh of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flipjax.train.loss import Losses, cross_entropy, hidden_states, losses

DATA_AXIS = "data"


class StepMetrics(NamedTuple):
    losses: Losses
    grad_norm: jax.Array
    finite: jax.Array  # the loss and every gradient are finite


class EvalSums(NamedTuple):
    nats: float  # next-token nats summed over the predicted tokens
    tokens: int
    mtp_nats: float
    mtp_tokens: int
    mtp_agree: int  # MTP's greedy t+2 equal to the model's greedy t+2 (from t+1)


def data_mesh(devices: Sequence[jax.Device]) -> Mesh:
    return Mesh(np.asarray(devices), (DATA_AXIS,))


class Trainer:
    def __init__(
        self,
        graphdef: nnx.GraphDef,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        mtp_weight: float,
    ):
        self.graphdef = graphdef
        self.optimizer = optimizer
        self.mesh = mesh
        self.mtp_weight = mtp_weight
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
        self._step = jax.jit(self._update, donate_argnums=(0, 1))
        self._gradients = jax.jit(jax.value_and_grad(self._loss, has_aux=True))
        self._eval = jax.jit(self._eval_sums)

    def place(self, tree: Any) -> Any:
        """A copy of `tree` replicated on the mesh."""
        return jax.device_put(tree, self.replicated)

    def init_optimizer(self, params: nnx.State) -> Any:
        return jax.jit(self.optimizer.init, out_shardings=self.replicated)(params)

    def batch(self, tokens: np.ndarray) -> jax.Array:
        if tokens.shape[0] % self.mesh.size:
            raise ValueError(
                f"--batch-size: {tokens.shape[0]} rows do not split over {self.mesh.size} devices"
            )
        return jax.device_put(jnp.asarray(tokens, jnp.int32), self.batch_sharding)

    def step(
        self, params: nnx.State, opt_state: Any, tokens: jax.Array
    ) -> tuple[nnx.State, Any, StepMetrics]:
        """One micro-batch: params and opt_state are donated (the caller keeps the results)."""
        return self._step(params, opt_state, tokens)

    def gradients(self, params: nnx.State, tokens: jax.Array) -> tuple[Losses, nnx.State]:
        """The loss terms and the gradient of the total over the batch, without an update."""
        (_, terms), grads = self._gradients(params, tokens)
        return terms, grads

    def evaluate(self, params: nnx.State, tokens: jax.Array) -> EvalSums:
        nats, count, mtp_nats, mtp_count, agree = (x.item() for x in self._eval(params, tokens))
        return EvalSums(nats, int(count), mtp_nats, int(mtp_count), int(agree))

    def _loss(self, params: nnx.State, tokens: jax.Array) -> tuple[jax.Array, Losses]:
        model = nnx.merge(self.graphdef, params)
        terms = losses(model, tokens, jnp.ones(tokens.shape, bool), self.mtp_weight)
        return terms.total, terms

    def _update(
        self, params: nnx.State, opt_state: Any, tokens: jax.Array
    ) -> tuple[nnx.State, Any, StepMetrics]:
        (_, terms), grads = jax.value_and_grad(self._loss, has_aux=True)(params, tokens)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(terms.total) & jnp.isfinite(grad_norm)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, StepMetrics(terms, grad_norm, finite)

    def _eval_sums(self, params: nnx.State, tokens: jax.Array) -> tuple[jax.Array, ...]:
        model = nnx.merge(self.graphdef, params)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        hidden, mtp_hidden = hidden_states(model, tokens, positions)
        logits = model.logits(hidden)
        ones = jnp.ones((b, t - 1), jnp.float32)
        nats = cross_entropy(logits[:, :-1], tokens[:, 1:], ones) * ones.sum()
        zero = jnp.zeros((), jnp.float32)
        mtp_nats, mtp_count, agree = zero, zero, zero
        if mtp_hidden is not None:
            mtp_logits = model.logits(mtp_hidden[:, :-1])  # at t, for token t+2
            mtp_count = jnp.asarray(b * (t - 2), jnp.float32)
            mtp_nats = cross_entropy(mtp_logits, tokens[:, 2:], ones[:, 1:]) * mtp_count
            base = jnp.argmax(logits[:, 1:-1], axis=-1)  # at t+1, for token t+2
            agree = jnp.sum(jnp.argmax(mtp_logits, axis=-1) == base).astype(jnp.float32)
        return nats, ones.sum(), mtp_nats, mtp_count, agree
