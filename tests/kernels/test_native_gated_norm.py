"""The native GDN output norm (`kernels_pallas/gdn/gated_norm.cc`) against the same formula in
float64 and against `RMSNormGated`'s XLA form, for every instruction set this CPU runs: head
widths in and out of a vector's multiple, gates far into either tail of the exp (where the
kernel's polynomial clamps), an all-zero head (where eps alone sets the scale)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flipjax.model.layers import RMSNormGated
from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.gdn import native_binding

EPS = 1e-6


def inputs(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(d)
    x = rng.normal(size=(3, 2, 5, d)).astype(np.float32)
    z = (rng.normal(size=x.shape) * 4).astype(np.float32)
    z[0, 0, 0] = np.linspace(-120, 120, d)  # past both ends of the exp's clamp
    z[0, 0, 1] = 0.0
    x[0, 1, 2] = 0.0  # rsqrt(eps): a zero output, not a NaN
    x[1, 0, 3] *= 1e-4  # eps weighs in
    return x, z, rng.uniform(0.5, 1.5, size=d).astype(np.float32)


def float64_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, z = x.astype(np.float64), z.astype(np.float64)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    return w * normed * (z / (1 + np.exp(-z)))


@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("d", [1, 24, 64, 128])
def test_the_kernel_is_the_norm(isa, d):
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    x, z, w = inputs(d)
    kernel = jax.jit(native_binding.gated_norm, static_argnums=(0, 4))
    got = np.asarray(kernel(native.target("gated_norm", isa), x, z, w, EPS))
    assert got.shape == x.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, float64_norm(x, z, w), rtol=2e-6, atol=1e-30)
    np.testing.assert_array_equal(got[0, 1, 2], 0.0)


def test_the_layer_runs_the_kernel_in_native_mode_and_matches_its_xla_form():
    x, z, w = inputs(64)
    norm = RMSNormGated(64, EPS, dtype=jnp.float32, rngs=nnx.Rngs(0))
    norm.weight[...] = jnp.asarray(w)
    graph, state = nnx.split(norm)

    one_device = jax.sharding.Mesh(jax.devices()[:1], ("x",))

    def program(mode: str) -> jax.stages.Lowered:
        with dispatch.kernels(mode), head_parallel.across(one_device):
            return jax.jit(lambda s, a, b: nnx.merge(graph, s)(a, b)).lower(state, x, z)

    native_program, xla_program = program("native"), program("reference")
    assert "flipjax_gated_norm" in native_program.as_text()
    assert "flipjax_gated_norm" not in xla_program.as_text()
    got = np.asarray(native_program.compile()(state, x, z))
    want = np.asarray(xla_program.compile()(state, x, z))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    with dispatch.kernels("native"), head_parallel.across(one_device):  # bf16: XLA's form
        assert dispatch.gated_norm(jnp.bfloat16, 5, EPS) is None


def test_mismatched_shapes_are_refused_by_name():
    x = jnp.zeros((2, 4, 8), jnp.float32)
    target = native.target("gated_norm")
    with pytest.raises(ValueError, match=r"gated norm: need x and z of one shape"):
        native_binding.gated_norm(target, x, x[:, :3], jnp.ones(8), EPS)
    with pytest.raises(ValueError, match=r"gated norm: need x and z of one shape"):
        native_binding.gated_norm(target, x, x, jnp.ones(7), EPS)
    with pytest.raises(ValueError, match="must be float32"):
        native_binding.gated_norm(target, x.astype(jnp.bfloat16), x, jnp.ones(8), EPS)
    ffi = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    with pytest.raises(Exception, match="gated norm: need x and z of one shape"):
        jax.block_until_ready(ffi(x, x, jnp.ones(7), eps=np.float32(EPS)))
