"""The native small-batch matmul: equal to the float64 product on every tile shape it cuts,
independent of the batch a row sits in, refused where it must not run, and offered for decode
rows on one device only.

The oracle is numpy's float64 product. Which layouts' steps run it, and that they give the
tokens of the engine with the kernels off, is checked in `test_native_kernels.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from flipjax.model.layers import Linear
from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.matmul import calibration
from kernels_pallas.matmul import native_binding as matmul_native


def _run(x: np.ndarray, w: np.ndarray | jax.Array, isa: str = "native") -> np.ndarray:
    matmul = functools.partial(matmul_native.matmul, matmul_native.targets(isa))
    return np.asarray(jax.jit(matmul)(x, w))


def _needs(isa: str) -> None:
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")


def _operands(rows: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.normal(size=(rows, k)).astype(np.float32), r.normal(size=(k, n)).astype(np.float32)


# Columns: whole panels (384 with AVX-512, 192 with AVX2), whole vectors after them, a part
# vector after those, and a product narrower than one vector; products large enough for two
# threads, whose columns are split evenly between them into tasks that are not a whole number
# of sub-tiles (37 vectors: 18 and 19). Rows: groups of 8 (4) and the rows left over. K
# crosses the 64-row blocks.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize(
    "k,n", [(1, 5), (7, 16), (65, 821), (130, 384), (64, 397), (300, 597), (700, 176)]
)
def test_the_kernel_is_the_float64_product(rows, k, n):
    x, w = _operands(rows, k, n)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = _run(x, w)
    assert got.shape == (rows, n) and got.dtype == np.float32
    # fp32 sums of k products of unit normals: rounding grows with sqrt(k).
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * 8)


@pytest.mark.parametrize("rows", [1, 8, 9, 33])
@pytest.mark.parametrize("k,n", [(65, 821), (3, 21)])
def test_a_bf16_weight_is_widened_exactly_and_accumulated_in_fp32(rows, k, n):
    x, w = _operands(rows, k, n, seed=2)
    w16 = jnp.asarray(w, jnp.bfloat16)
    # The oracle: the bf16 values themselves, multiplied in float64.
    want = x.astype(np.float64) @ np.asarray(w16.astype(jnp.float32), np.float64)
    got = _run(x, w16)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * 8)


# Each instruction set this machine runs, built here, so that the claim holds on the CPUs of
# other machines too (it once held on AVX-512 and failed under AVX2 with Zen tuning).
@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("rows", [9, 37])
def test_a_rows_result_does_not_depend_on_its_batch(isa, rows):
    _needs(isa)
    # 9 rows: two groups on every instruction set, whose tasks pack runs of sub-tiles under
    # AVX2; 37: more than two groups, packed a sub-tile at a time.
    x, w = _operands(rows, 200, 500, seed=1)
    together = _run(x, w, isa)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(together, want, rtol=0, atol=2e-6 * np.sqrt(200) * 8)
    for i in range(rows):
        np.testing.assert_array_equal(_run(x[i : i + 1], w, isa)[0], together[i])


def test_every_build_with_fma_gives_the_same_bits():
    """Lanes are columns and each sums over k in order, so vector width changes nothing."""
    fused = [isa for isa in ("native", "x86-64-v3", "x86-64-v4") if native.runs_here(isa)]
    x, w = _operands(9, 130, 397, seed=3)
    first = _run(x, w, fused[0])
    for isa in fused[1:]:
        np.testing.assert_array_equal(_run(x, w, isa), first, err_msg=isa)


def test_bad_operands_are_refused_by_name():
    targets = matmul_native.targets()
    x, w = _operands(2, 8, 16)
    with pytest.raises(ValueError, match="x must be float32 .* got bfloat16 and float32"):
        matmul_native.matmul(targets, jnp.asarray(x, jnp.bfloat16), w)
    with pytest.raises(ValueError, match="w one of .* got float32 and float16"):
        matmul_native.matmul(targets, x, w.astype(np.float16))
    with pytest.raises(ValueError, match=r"need x \[M, K\] and w \[K, N\], got \(2, 8\) and"):
        matmul_native.matmul(targets, x, w[:4])


def test_it_is_offered_for_decode_rows_on_one_device_only():
    # The rows are the suite's pinned choice (tests/conftest.py); each machine measures its own.
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    two = Mesh(np.array(jax.devices()[:2]), ("tp",))
    f32 = jnp.float32
    assert dispatch.matmul(8, 768, f32) is None  # outside a placed program: unknown devices
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(8, 768, f32).func is matmul_native.matmul
        assert dispatch.matmul(2, 128, f32) is not None and dispatch.matmul(32, 128, f32)
        assert dispatch.matmul(1, 768, f32) is None  # XLA's matvec streams at full speed
        assert dispatch.matmul(33, 768, f32) is None  # the GEMM's packing pays from here
        assert dispatch.matmul(8, 127, f32) is None
        bf16 = jnp.bfloat16
        assert dispatch.matmul(1, 768, bf16) is not None and dispatch.matmul(8, 768, bf16)
        assert dispatch.matmul(9, 768, bf16) is None  # XLA's bf16 GEMM from here
        assert dispatch.matmul(4, 768, jnp.float16) is None
    with dispatch.kernels("native"), head_parallel.across(two):
        assert dispatch.matmul(8, 768, f32) is None  # would gather a sharded weight
    with dispatch.kernels("reference"), head_parallel.across(one):
        assert dispatch.matmul(8, 768, f32) is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (2,), (2, 3), (5, 8)])
def test_a_linear_on_one_device_runs_the_kernel_and_gives_its_product(dtype, lead):
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    lin = Linear(256, 384, dtype=dtype, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (*lead, 256)).astype(dtype)
    want = x.astype(jnp.float32) @ lin.kernel[...].astype(jnp.float32)
    with dispatch.kernels("native"), head_parallel.across(one):
        program = jax.jit(lin.__call__).lower(x)
        got = lin(x)
    uses = "flipjax_matmul" in program.as_text()
    rows = math.prod(lead)
    assert uses == (rows in calibration.native_rows(dtype))  # 40 rows: neither
    assert got.shape == want.shape and got.dtype == dtype
    tol = dict(rtol=2**-7, atol=1e-6) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)


def test_the_build_the_kernels_run_is_chosen_by_its_variable(monkeypatch):
    """`FLIPJAX_NATIVE_ARCH` picks the instruction set, so one machine runs another's code."""
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    monkeypatch.setenv(native.ARCH_ENV, "x86-64-v3")
    with dispatch.kernels("native"), head_parallel.across(one):
        x, w = _operands(4, 64, 256)
        program = jax.jit(lambda x, w: dispatch.matmul(4, 256, jnp.float32)(x, w)).lower(x, w)
    assert "flipjax_matmul_x86_64_v3" in program.as_text()
    monkeypatch.setenv(native.ARCH_ENV, "avx9")
    with pytest.raises(ValueError, match="FLIPJAX_NATIVE_ARCH: unknown instruction set 'avx9'"):
        native.target("matmul")
    monkeypatch.setenv(native.ARCH_ENV, "x86-64-v4")
    monkeypatch.setitem(native.ISA_NEEDS, "x86-64-v4", ("a_feature_no_cpu_has",))
    with pytest.raises(ValueError, match="x86-64-v4: this CPU lacks some of"):
        native.target("matmul")
