"""The native grouped matmul of the experts: each group's rows times its own weight, equal to
the float64 product, with empty groups skipped and rows past the groups zero; a row's result
depends on neither its group's size nor the batch, on every instruction set this machine runs;
group sizes that do not fit are refused; and `dispatch.ragged_dot` runs it wherever the
mixture-of-experts block runs in `native` mode, on one device or per device over a TP mesh.

The oracle is numpy's float64 product, group by group. That the engine's steps run it on every
layout and give the tokens of the engine with the kernels off is in `test_native_kernels.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from flipjax.model.config import ModelConfig
from flipjax.model.mlp import Qwen3NextSparseMoeBlock
from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.matmul import native_binding as matmul_native
from kernels_pallas.ragged_matmul import native_binding as ragged_native


def _run(x, w, sizes, isa: str = "native") -> np.ndarray:
    ragged = functools.partial(ragged_native.ragged_matmul, ragged_native.targets(isa))
    return np.asarray(jax.jit(ragged)(x, w, np.asarray(sizes, np.int32)))


def _float64(x: np.ndarray, w: np.ndarray, sizes: list[int]) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size].astype(np.float64) @ w[g]
        start += size
    return out


def _operands(rows: int, groups: int, k: int, n: int, seed: int = 0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(rows, k)).astype(np.float32)
    return x, r.normal(size=(groups, k, n)).astype(np.float32)


# Groups empty, of one row, and of more rows than a register tile; columns across whole
# panels, whole vectors and a part vector; K across the 64-row blocks; rows after the groups.
@pytest.mark.parametrize(
    "sizes,k,n",
    [([0, 1, 0, 2], 7, 16), ([3, 0, 9, 1], 65, 397), ([17, 4], 130, 821), ([1, 1, 1], 64, 5)],
)
def test_each_group_is_its_float64_product_and_rows_past_them_are_zero(sizes, k, n):
    rows = sum(sizes) + 3
    x, w = _operands(rows, len(sizes), k, n)
    got = _run(x, w, sizes)
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, _float64(x, w, sizes), rtol=0, atol=2e-6 * np.sqrt(k) * 8)
    np.testing.assert_array_equal(got[sum(sizes) :], 0)


def test_a_bf16_weight_is_widened_exactly_and_accumulated_in_fp32():
    x, w = _operands(9, 3, 65, 200, seed=2)
    w16 = jnp.asarray(w, jnp.bfloat16)
    want = _float64(x, np.asarray(w16.astype(jnp.float32), np.float64), [4, 0, 5])
    np.testing.assert_allclose(_run(x, w16, [4, 0, 5]), want, rtol=0, atol=2e-6 * 8 * 8)


@pytest.mark.parametrize("isa", sorted(native.ISAS))
def test_a_rows_result_depends_on_neither_its_group_nor_its_batch(isa):
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    x, w = _operands(37, 3, 200, 300, seed=1)
    sizes = [6, 0, 31]  # the last group more than two groups of rows: its w is packed
    together = _run(x, w, sizes, isa)
    np.testing.assert_allclose(together, _float64(x, w, sizes), rtol=0, atol=2e-6 * 15 * 8)
    matmul = jax.jit(functools.partial(matmul_native.matmul, matmul_native.targets(isa)))
    for i in range(37):
        group = 0 if i < 6 else 2
        alone = _run(x[i : i + 1], w, [int(g == group) for g in range(3)], isa)[0]
        np.testing.assert_array_equal(alone, together[i])
        if i:  # the same streamed multiply as the native matmul (one row there is XLA's)
            np.testing.assert_array_equal(np.asarray(matmul(x[i - 1 : i + 1], w[group]))[1], alone)


@pytest.mark.parametrize(
    "sizes,match",
    [([2, -1, 1], "group 1 has a negative size"), ([3, 3, 0], "sum to 6, more than the 4 rows")],
)
def test_group_sizes_that_do_not_fit_the_rows_are_refused(sizes, match):
    x, w = _operands(4, 3, 8, 16)
    with pytest.raises(Exception, match=match):
        _run(x, w, sizes)


def test_bad_operands_are_refused_by_name():
    targets = ragged_native.targets()
    x, w = _operands(4, 3, 8, 16)
    sizes = jnp.array([1, 2, 1], jnp.int32)
    with pytest.raises(ValueError, match="x must be float32 .* got bfloat16 and float32"):
        ragged_native.ragged_matmul(targets, jnp.asarray(x, jnp.bfloat16), w, sizes)
    with pytest.raises(ValueError, match=r"need x \[M, K\] and w \[G, K, N\]"):
        ragged_native.ragged_matmul(targets, x, w[0], sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be \[3\], got \(2,\)"):
        ragged_native.ragged_matmul(targets, x, w, sizes[:2])
    with pytest.raises(ValueError, match="split must be 'in' or 'out'"):
        dispatch.ragged_dot(x, w, sizes, split="rows")


def _moe_block() -> tuple[Qwen3NextSparseMoeBlock, jax.Array]:
    cfg = ModelConfig.from_hf(
        dict(
            model_type="qwen3_next",
            vocab_size=64,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            layer_types=["full_attention"],
        )
    )
    block = Qwen3NextSparseMoeBlock(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    return block, jax.random.normal(jax.random.PRNGKey(4), (11, 64))


def _block_under(block, x, mode: str, mesh: Mesh | None) -> tuple[np.ndarray, str]:
    graph, state = nnx.split(block)

    def run(state, x):
        with dispatch.kernels(mode), head_parallel.across(mesh):
            return nnx.merge(graph, state)(x)

    program = jax.jit(run).lower(state, x).compile().as_text()
    return np.asarray(jax.jit(run)(state, x)), program


@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_moe_block_runs_the_kernel_on_one_device_and_per_device_over_a_mesh(width):
    block, x = _moe_block()
    want, program = _block_under(block, x, "reference", None)
    assert "flipjax_ragged_matmul" not in program
    mesh = Mesh(np.array(jax.devices()[:width]), ("tp",))
    got, program = _block_under(block, x, "native", mesh)
    assert "flipjax_ragged_matmul" in program
    # Per device over its share of the experts' intermediate dimension, none gathered.
    assert f"f32[8,64,{48 // width}]" in program and "all-gather" not in program
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Outside a placed program the devices are unknown: XLA's ragged_dot runs.
    assert "flipjax_ragged_matmul" not in _block_under(block, x, "native", None)[1]
