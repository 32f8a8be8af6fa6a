"""The native kernels on int8 (quantized) weights: the dense and the grouped matmul widen each
int8 exactly and equal the float64 product on every tile shape; a row's result does not depend
on its batch on any instruction set this machine runs; and `dispatch.quantized_matmul` /
`dispatch.ragged_dot(scale=)` give `(x @ q) * scale` on one device, per device over a TP mesh
(each device its own shard of the weight and its scales), and through XLA's dot elsewhere.

The oracle is numpy's float64 product of the int8 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.matmul import native_binding as matmul_native
from kernels_pallas.matmul.xla_form import xla_int8_matmul
from kernels_pallas.ragged_matmul import native_binding as ragged_native
from tests.support.hlo_checks import widened_whole


def _int8(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-127, 128, shape).astype(np.int8)


def _x(rows: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, k)).astype(np.float32)


def _dense(x: np.ndarray, q: np.ndarray, isa: str = "native") -> np.ndarray:
    matmul = functools.partial(matmul_native.matmul, matmul_native.targets(isa))
    return np.asarray(jax.jit(matmul)(x, q))


# int8 products are up to 127x a unit normal's: the fp32 rounding scales with them.
def _tol(k: int) -> dict[str, float]:
    return dict(rtol=0, atol=2e-6 * np.sqrt(k) * 8 * 127)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(1, 5), (7, 16), (65, 821), (130, 384), (64, 397)])
def test_the_int8_kernel_is_the_float64_product_of_the_int8_values(rows, k, n):
    x, q = _x(rows, k), _int8((k, n), 1)
    got = _dense(x, q)
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ q.astype(np.float64), **_tol(k))


@pytest.mark.parametrize("isa", sorted(native.ISAS))
def test_an_int8_rows_result_does_not_depend_on_its_batch(isa):
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    x, q = _x(37, 200, 2), _int8((200, 500), 3)  # 37 rows: w is packed (more than two groups)
    together = _dense(x, q, isa)
    np.testing.assert_allclose(together, x.astype(np.float64) @ q, **_tol(200))
    for i in range(37):
        np.testing.assert_array_equal(_dense(x[i : i + 1], q, isa)[0], together[i])


def test_the_grouped_int8_kernel_is_each_groups_float64_product():
    sizes, k, n = [3, 0, 9, 1], 65, 397
    x, q = _x(sum(sizes) + 2, k), _int8((len(sizes), k, n), 4)
    ragged = functools.partial(ragged_native.ragged_matmul, ragged_native.targets())
    got = np.asarray(jax.jit(ragged)(x, q, np.asarray(sizes, np.int32)))
    want = np.zeros((x.shape[0], n))
    groups = np.repeat(np.arange(len(sizes)), sizes)
    want[: len(groups)] = np.einsum("mk,mkn->mn", x[: len(groups)].astype(np.float64), q[groups])
    np.testing.assert_allclose(got, want, **_tol(k))


def _scaled(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ q.astype(np.float64)) * scale


# 6 rows: the kernel; 64 rows: past the suite's pinned native rows, XLA's GEMM on blocks.
@pytest.mark.parametrize("rows", [6, 64])
@pytest.mark.parametrize("split", ["out", "in"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_quantized_matmul_runs_per_device_and_scales_each_column(rows, split, devices):
    k, n = 256, 384
    x, q = _x(rows, k, 5), _int8((k, n), 6)
    scale = np.random.default_rng(7).uniform(0.001, 0.02, n).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))
    # The weight and scales sharded as the TP layout shards them (`sharding.layout.tp_rule`).
    w_spec, s_spec = (P(None, "tp"), P("tp")) if split == "out" else (P("tp", None), P())
    qd = jax.device_put(q, NamedSharding(mesh, w_spec))
    sd = jax.device_put(scale, NamedSharding(mesh, s_spec))

    def run(x: jax.Array, q: jax.Array, s: jax.Array) -> jax.Array:
        with dispatch.kernels("native"), head_parallel.across(mesh):
            return dispatch.quantized_matmul(x, q, s, split=split)

    text = jax.jit(run).lower(x, qd, sd).compile().as_text()
    assert ("flipjax_matmul_int8" in text) == (rows == 6)
    assert widened_whole(text) == []
    # The fp32 sums' rounding, scaled: split over `in`, each device's partial sum rounds on its
    # own, and a 1e-5 bound failed on a Zen 3 (1.1e-5 off in one of 24576).
    tol = dict(rtol=0, atol=_tol(k)["atol"] * float(scale.max()))
    np.testing.assert_allclose(np.asarray(jax.jit(run)(x, qd, sd)), _scaled(x, q, scale), **tol)
    # The references (and a GPU) take XLA's dot of the widened weight: the same product.
    with dispatch.kernels("reference"):
        ref = dispatch.quantized_matmul(jnp.asarray(x), q, scale, split=split)
    np.testing.assert_allclose(np.asarray(ref), _scaled(x, q, scale), **tol)


# 1001 columns: the last block of 126 starts where it fits, and rewrites its neighbour's.
@pytest.mark.parametrize("n", [1024, 1001])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xlas_int8_gemm_widens_one_block_at_a_time_and_gives_the_product(dtype, n):
    x, q = _x(4, 512, 11), _int8((512, n), 12)
    xj = jnp.asarray(x, dtype)
    compiled = jax.jit(xla_int8_matmul).lower(xj, q).compile()
    assert widened_whole(compiled.as_text()) == []
    # What XLA holds beside its operands and result: one widened block, not the weight.
    whole = q.size * jnp.dtype(dtype).itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < whole / 4
    got = np.asarray(xla_int8_matmul(xj, q))
    xd = np.asarray(xj.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, xd @ q.astype(np.float64), rtol=1e-5, atol=1e-3)
    plain = jax.jit(lambda x, q: x @ q.astype(x.dtype)).lower(xj, q).compile()
    assert widened_whole(plain.as_text())  # the check sees XLA's own widening
    assert plain.memory_analysis().temp_size_in_bytes >= whole


@pytest.mark.parametrize("mode", ["native", "reference"])
def test_ragged_dot_scales_each_rows_product_by_its_groups_columns(mode):
    sizes, k, n = [2, 0, 3, 1], 64, 200
    x, q = _x(sum(sizes), k, 8), _int8((len(sizes), k, n), 9)
    scale = np.random.default_rng(10).uniform(0.001, 0.02, (len(sizes), n)).astype(np.float32)
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with dispatch.kernels(mode), head_parallel.across(one):
        got = dispatch.ragged_dot(
            jnp.asarray(x), q, jnp.asarray(sizes, jnp.int32), split="out", scale=scale
        )
    groups = np.repeat(np.arange(len(sizes)), sizes)
    want = np.einsum("mk,mkn->mn", x.astype(np.float64), q[groups]) * scale[groups]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_quantized_matmul_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="split must be 'in' or 'out', got 'rows'"):
        dispatch.quantized_matmul(
            jnp.ones((1, 4)), jnp.ones((4, 4), jnp.int8), jnp.ones(4), split="rows"
        )
