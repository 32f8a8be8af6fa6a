"""`tiny` is made once per process and dtype; each call still gives a module of its own, so one
caller setting a weight (or an engine freeing the arrays it placed) changes no other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.model.tiny import tiny_model


def _weights(model) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(nnx.state(model))]


def test_each_tiny_module_is_its_own():
    first = tiny_model(jnp.float32)
    kept = _weights(first)
    first.model.norm.weight.value = jnp.full_like(first.model.norm.weight.value, 7.0)
    second = tiny_model(jnp.float32)
    assert second is not first
    assert all(np.array_equal(a, b) for a, b in zip(_weights(second), kept, strict=True))
    assert float(first.model.norm.weight.value[0]) == 7.0
    # Another dtype is another set of weights, the same values rounded.
    half = tiny_model(jnp.bfloat16)
    rounded = [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(half))]
    assert all(np.allclose(a, b, atol=0.02, rtol=0.02) for a, b in zip(rounded, kept, strict=True))
