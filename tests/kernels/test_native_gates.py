"""The native gated products (`kernels_pallas/pointwise/gates.cc`) against the same formulas in
float64 and against the model's XLA forms, for every instruction set this CPU runs: lengths in
and out of a vector's multiple and of a task's chunk, gates far into either tail of the exp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flipjax.model.mlp import Qwen3NextMLP
from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.pointwise import native_binding


def inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    g = (rng.normal(size=(2, n)) * 4).astype(np.float32)
    g[0, : min(n, 7)] = [-120.0, -88.0, -20.0, 0.0, 20.0, 89.0, 120.0][: min(n, 7)]
    return g, rng.normal(size=(2, n)).astype(np.float32)


@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("n", [1, 7, 17, 4096 + 5, 70000])
def test_the_kernels_are_the_gates(isa, n):
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    g, x = inputs(n)
    sigmoid = 1 / (1 + np.exp(-g.astype(np.float64)))
    for activation, want in (("silu", g * sigmoid * x), ("sigmoid", x * sigmoid)):
        got = jax.jit(native_binding.gate, static_argnums=(0, 3))(activation, g, x, isa)
        assert got.shape == x.shape and np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-30)


def test_the_mlp_runs_the_kernel_on_one_device_and_matches_its_xla_form():
    mlp = Qwen3NextMLP(32, 48, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graph, state = nnx.split(mlp)
    x = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
    one_device = jax.sharding.Mesh(jax.devices()[:1], ("x",))

    def program(mode: str) -> jax.stages.Lowered:
        with dispatch.kernels(mode), head_parallel.across(one_device):
            return jax.jit(lambda s, a: nnx.merge(graph, s)(a)).lower(state, x)

    kernel, xla = program("native"), program("reference")
    assert "flipjax_silu_mul" in kernel.as_text() and "flipjax_silu_mul" not in xla.as_text()
    got, want = np.asarray(kernel.compile()(state, x)), np.asarray(xla.compile()(state, x))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_bad_inputs_are_refused_by_name():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="gate: activation 'relu' is not one of"):
        native_binding.gate("relu", x, x)
    with pytest.raises(ValueError, match="gate: g and x must be float32 of one shape"):
        native_binding.gate("silu", x, x[:, :4])
    with pytest.raises(ValueError, match="gate: g and x must be float32 of one shape"):
        native_binding.gate("sigmoid", x.astype(jnp.bfloat16), x)
    ffi = jax.ffi.ffi_call(native.target("silu_mul"), jax.ShapeDtypeStruct(x.shape, jnp.float32))
    with pytest.raises(Exception, match="gate: g and x must have one shape"):
        jax.block_until_ready(ffi(x[:, :4], x))
