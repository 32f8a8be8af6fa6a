"""The native small-batch matmul: equal to the float64 product on every tile shape it cuts,
independent of the batch a row sits in, refused where it must not run, and offered for decode
rows on one device only.

The oracle is numpy's float64 product. Which layouts' steps run it, and that they give the
tokens of the engine with the kernels off, is checked in `test_native_kernels.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas import dense_native, dispatch, head_parallel, native


def _run(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    call = jax.jit(dense_native.matmul, static_argnums=0)
    return np.asarray(call(native.target("matmul"), jnp.asarray(x), jnp.asarray(w)))


def _operands(rows: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.normal(size=(rows, k)).astype(np.float32), r.normal(size=(k, n)).astype(np.float32)


# Columns: whole panels (384 with AVX-512, 192 with AVX2), whole vectors after them, a part
# vector after those, and a product narrower than one vector. Rows: groups of 8 (4) and the
# rows left over. K crosses the 64-row blocks.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(1, 5), (7, 16), (65, 821), (130, 384), (64, 397)])
def test_the_kernel_is_the_float64_product(rows, k, n):
    x, w = _operands(rows, k, n)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = _run(x, w)
    assert got.shape == (rows, n) and got.dtype == np.float32
    # fp32 sums of k products of unit normals: rounding grows with sqrt(k).
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * 8)


def test_a_rows_result_does_not_depend_on_its_batch():
    x, w = _operands(13, 200, 500, seed=1)
    together = _run(x, w)
    for i in range(13):
        np.testing.assert_array_equal(_run(x[i : i + 1], w)[0], together[i])


def test_bad_operands_are_refused_by_name():
    target = native.target("matmul")
    x, w = _operands(2, 8, 16)
    with pytest.raises(ValueError, match="must be float32, got bfloat16"):
        dense_native.matmul(target, jnp.asarray(x, jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"need x \[M, K\] and w \[K, N\], got \(2, 8\) and"):
        dense_native.matmul(target, x, w[:4])


def test_it_is_offered_for_fp32_decode_rows_on_one_device_only():
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    two = Mesh(np.array(jax.devices()[:2]), ("tp",))
    f32 = jnp.float32
    assert dispatch.matmul(8, 768, f32) is None  # outside a placed program: unknown devices
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(8, 768, f32).func is dense_native.matmul
        assert dispatch.matmul(2, 128, f32) is not None and dispatch.matmul(16, 128, f32)
        assert dispatch.matmul(1, 768, f32) is None  # XLA's matvec streams at full speed
        assert dispatch.matmul(17, 768, f32) is None  # the GEMM's packing pays from here
        assert dispatch.matmul(8, 127, f32) is None
        assert dispatch.matmul(8, 768, jnp.bfloat16) is None
    with dispatch.kernels("native"), head_parallel.across(two):
        assert dispatch.matmul(8, 768, f32) is None  # would gather a sharded weight
    with dispatch.kernels("reference"), head_parallel.across(one):
        assert dispatch.matmul(8, 768, f32) is None
