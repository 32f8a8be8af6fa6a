"""Several weights times one x in a call of the native matmul (`matmul_native.matmuls`): each
product bit for bit the kernel's own for that weight, refused by name where it must not run, and
taken by a layer's projections (`layers.project`) where the kernel takes their rows.

The oracle is the single-weight kernel (`test_native_matmul.py` checks it against float64) and,
for the layer, each Linear's own product.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from flipjax.model.layers import Linear, project
from flipjax.model.quantize import quantize_int8
from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.matmul import native_binding as matmul_native


def _needs(isa: str) -> None:
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")


def _weights(k: int, columns: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [r.normal(size=(k, n)).astype(np.float32) for n in columns]


# A GDN layer's projections (a wide weight and a 24-column one), attention's three, a weight
# narrower than a vector between wider ones, and products large enough for two threads.
@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 33])
@pytest.mark.parametrize("columns", [(24,), (389, 24), (160, 16, 16), (5, 397, 1, 2048)])
def test_each_weight_in_one_call_is_its_own_product_bit_for_bit(isa, rows, columns):
    _needs(isa)
    k = 130  # crosses the kernel's 64-row blocks
    x = np.random.default_rng(1).normal(size=(rows, k)).astype(np.float32)
    ws = _weights(k, columns)
    several = matmul_native.targets(isa, matmul_native.SEVERAL)
    got = jax.jit(functools.partial(matmul_native.matmuls, several))(x, ws)
    one = jax.jit(functools.partial(matmul_native.matmul, matmul_native.targets(isa)))
    assert len(got) == len(ws)
    for y, w in zip(got, ws, strict=True):
        assert y.shape == (rows, w.shape[1]) and y.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(y), np.asarray(one(x, w)))


def test_bf16_weights_in_one_call_are_each_their_own_product():
    x = np.random.default_rng(1).normal(size=(5, 96)).astype(np.float32)
    ws = [jnp.asarray(w, jnp.bfloat16) for w in _weights(96, (200, 24))]
    several = matmul_native.targets(None, matmul_native.SEVERAL)
    got = matmul_native.matmuls(several, x, ws)
    for y, w in zip(got, ws, strict=True):
        want = matmul_native.matmul(matmul_native.targets(), x, w)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_bad_operands_are_refused_by_name():
    several = matmul_native.targets(None, matmul_native.SEVERAL)
    x = np.ones((2, 8), np.float32)
    w8, w4 = np.ones((8, 16), np.float32), np.ones((4, 16), np.float32)
    with pytest.raises(ValueError, match="need at least one weight"):
        matmul_native.matmuls(several, x, [])
    with pytest.raises(
        ValueError,
        match=r"weights all one of .* got float32 \(2, 8\) and \['bfloat16', 'float32'\]",
    ):
        matmul_native.matmuls(several, x, [w8, jnp.asarray(w8, jnp.bfloat16)])
    with pytest.raises(ValueError, match=r"and \['int8'\]"):  # a quantized weight's own path
        matmul_native.matmuls(several, x, [w8.astype(np.int8)])
    with pytest.raises(ValueError, match=r"need weights \[K, N\] for x \(2, 8\), got \(4, 16\)"):
        matmul_native.matmuls(several, x, [w8, w4])
    # The handler checks what it is given too: an output that is not [M, N] is refused.
    wrong = (jax.ShapeDtypeStruct((2, 16), jnp.float32), jax.ShapeDtypeStruct((2, 15), jnp.float32))
    with pytest.raises(Exception, match="output 1 must be \\[M, N\\]"):
        jax.ffi.ffi_call(several[jnp.dtype(jnp.float32)], wrong)(x, w8, w8)


def _linears(dtype: jnp.dtype, *columns: int) -> list[Linear]:
    return [Linear(256, n, dtype=dtype, rngs=nnx.Rngs(i)) for i, n in enumerate(columns)]


def _quantized(linear: Linear) -> Linear:
    out = Linear(256, linear.kernel.shape[1], dtype=jnp.float32, rngs=nnx.Rngs(0))
    q, scale = quantize_int8(linear.kernel[...])
    out.kernel, out.scale, out.split = nnx.Param(q), nnx.Param(scale), "out"
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_layers_projections_take_one_call_and_give_each_linears_product(dtype):
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    linears = _linears(dtype, 384, 24)  # as a GDN layer's in_proj_qkvz and in_proj_ba
    x = jax.random.normal(jax.random.key(1), (2, 2, 256)).astype(dtype)
    with dispatch.kernels("native"), head_parallel.across(one):
        program = jax.jit(lambda x: project(x, *linears)).lower(x).as_text()
        got = project(x, *linears)
    assert len(re.findall(r"@flipjax_matmuls(_bf16)?\(", program)) == 1
    assert re.search(r"@flipjax_matmul(_bf16)?\(", program) is None
    assert "dot_general" not in program  # the 24-column weight's too
    for y, linear in zip(got, linears, strict=True):
        assert y.shape == (2, 2, linear.kernel.shape[1]) and y.dtype == dtype
        w = linear.kernel[...].astype(jnp.float32)
        want = matmul_native.matmul(
            matmul_native.targets(), x.reshape(4, 256).astype(jnp.float32), w
        )
        np.testing.assert_array_equal(
            np.asarray(y), np.asarray(want.astype(dtype)).reshape(y.shape)
        )


def test_projections_run_one_at_a_time_where_the_kernel_does_not_take_them_together():
    x = jax.random.normal(jax.random.key(1), (4, 256))
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    two = Mesh(np.array(jax.devices()[:2]), ("tp",))
    linears = _linears(jnp.float32, 384, 24)
    quantized = [_quantized(linear) for linear in linears]
    mixed = [linears[0], _linears(jnp.bfloat16, 24)[0]]
    cases = [(one, 64, linears), (one, 4, quantized), (one, 4, mixed), (two, 4, linears)]
    for mesh, rows, group in cases:  # 64 rows: XLA's GEMM; int8; two dtypes; a TP mesh
        xr = jnp.ones((rows, 256)) if rows != 4 else x
        with dispatch.kernels("native"), head_parallel.across(mesh):
            program = jax.jit(lambda x, group=group: project(x, *group)).lower(xr).as_text()
            got = project(xr, *group)
        assert "flipjax_matmuls" not in program
        for y, linear in zip(got, group, strict=True):
            with dispatch.kernels("native"), head_parallel.across(mesh):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(xr)))
