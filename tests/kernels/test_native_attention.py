"""The native decode attention kernel (`kernels_pallas/paged_attention/paged_decode.cc`) against
the pure-JAX paged attention, which the Pallas kernels and transformers are checked against
elsewhere.

Its engine use (every layout decodes to the reference tokens with it) is in
`test_native_kernels`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.paged_attention import native_binding as attention_native
from kernels_pallas.paged_attention.reference import paged_attention_reference

PAGES, PAGE = 64, 16
# A first page, a page's last slot, the next page's first, deep in the table, and padding.
POSITIONS = [0, 15, 16, 150, -1]


def case(dtype: jnp.dtype, kv_heads: int, group: int, dim: int, seed: int = 0, page: int = PAGE):
    rng = np.random.default_rng(seed)
    rows, width = len(POSITIONS), -(-max(POSITIONS) // page) + 2
    pages = max(PAGES, rows * width)
    k, v = (jnp.asarray(rng.normal(size=(pages, page, kv_heads, dim)), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(rows, 1, kv_heads * group, dim)), dtype)
    table = jnp.asarray(rng.permutation(pages)[: rows * width].reshape(rows, width), jnp.int32)
    return q, k, v, table, jnp.asarray(POSITIONS, jnp.int32)[:, None]


@pytest.mark.parametrize(
    "dtype,kv_heads,group,dim",
    [
        (jnp.float32, 2, 3, 64),
        (jnp.float32, 1, 4, 40),  # a head size that is no whole number of vectors
        (jnp.float32, 4, 1, 128),
        (jnp.bfloat16, 2, 6, 64),
    ],
)
def test_decode_is_the_reference_attention(dtype, kv_heads, group, dim):
    q, k, v, table, positions = case(dtype, kv_heads, group, dim)
    got = jax.jit(attention_native.decode)(q, k, v, table, positions)
    want = paged_attention_reference(q, k, v, table, positions)
    assert got.shape == want.shape and got.dtype == want.dtype
    real = slice(0, len(POSITIONS) - 1)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(got[real], np.float32), np.asarray(want[real], np.float32), rtol=tol, atol=tol
    )
    assert not np.any(np.asarray(got[-1], np.float32)), "a padding row's output is zero"


@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("page,dim", [(8, 64), (24, 64), (40, 128), (24, 40)])
def test_pages_of_any_size_against_the_reference(isa, page, dim):
    # The kernel takes scores a vector of positions at a time within a page: pages of half a
    # vector, of one and a half (a block of a page's last few) and of several; keys go through
    # registers a square of vectors at a time where the head is whole vectors (not 40).
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    q, k, v, table, positions = case(jnp.float32, 2, 3, dim, page=page)
    decode = functools.partial(attention_native.decode, isa=isa)
    got = jax.jit(decode)(q, k, v, table, positions)
    want = paged_attention_reference(q, k, v, table, positions)
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("group,dim", [(6, 64), (8, 64), (13, 32), (5, 40)])
def test_each_query_of_a_group_gets_bit_for_bit_what_it_gets_alone(isa, group, dim):
    # The kernel takes a KV head's queries a tile at a time (the scores and the values of several
    # queries from one read of each key and value, tiles of up to 7 and a last one of the rest),
    # and sums their softmax totals side by side: each query's sums keep their own order, so its
    # output is exactly what it gets as the only query of its KV head.
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    kv_heads = 2
    q, k, v, table, positions = case(jnp.float32, kv_heads, group, dim)
    decode = jax.jit(functools.partial(attention_native.decode, isa=isa))
    rows = q.shape[0]
    together = np.asarray(decode(q, k, v, table, positions)).reshape(rows, 1, kv_heads, group, dim)
    by_query = q.reshape(rows, 1, kv_heads, group, dim)
    for g in range(group):
        alone = np.asarray(decode(by_query[:, :, :, g], k, v, table, positions))
        np.testing.assert_array_equal(together[:, :, :, g], alone, err_msg=f"query {g}")


def test_decode_reads_only_the_pages_a_row_holds():
    q, k, v, table, positions = case(jnp.float32, 2, 3, 64)
    first = jax.jit(attention_native.decode)(q, k, v, table, positions)
    # Table entries past a row's last page may hold anything, even ids outside the pool.
    table = table.at[:, 11].set(PAGES + 7)
    again = jax.jit(attention_native.decode)(q, k, v, table, positions)
    np.testing.assert_array_equal(again, first)


def test_a_page_outside_the_pool_is_refused_by_name():
    q, k, v, table, positions = case(jnp.float32, 2, 3, 64)
    table = table.at[3, 2].set(PAGES)  # row 3 (position 150) reads its pages 0..9
    with pytest.raises(Exception, match=f"row 3 names page {PAGES} outside the pool"):
        jax.block_until_ready(jax.jit(attention_native.decode)(q, k, v, table, positions))


def test_decode_refuses_prefill_shapes():
    q, k, v, table, positions = case(jnp.float32, 2, 3, 64)
    with pytest.raises(ValueError, match="need q \\[B, 1, H, D\\]"):
        attention_native.decode(jnp.concatenate([q, q], axis=1), k, v, table, positions)


def lowered(mode: str, *args: jax.Array) -> str:
    """The program text of paged attention traced in `mode` (a new function each time: the
    mode is read at trace time, which jit's cache does not key on)."""
    with dispatch.kernels(mode):
        return jax.jit(lambda *a: dispatch.paged_attention(*a)).lower(*args).as_text()


def test_native_mode_takes_decode_and_verify_steps_and_leaves_prefill_to_the_reference():
    q, k, v, table, positions = case(jnp.float32, 2, 3, 64)
    rows, tokens = q.shape[0], dispatch.VERIFY_TOKENS
    verify = jnp.concatenate([q] * tokens, axis=1)
    at = jnp.where(positions >= 0, positions + jnp.arange(tokens), -1)  # each row's next few
    prefill = jnp.concatenate([q] * 16, axis=1)
    prefill_at = jnp.where(positions >= 0, positions + jnp.arange(16), -1)
    assert "flipjax_paged_decode" in lowered("native", q, k, v, table, positions)
    assert "flipjax_paged_decode" in lowered("native", verify, k, v, table, at)
    assert "flipjax_paged_decode" not in lowered("native", prefill, k, v, table, prefill_at)
    assert "flipjax_paged_decode" not in lowered("reference", q, k, v, table, positions)
    # A verify step's positions attend causally within their row, as the reference's do.
    want = paged_attention_reference(verify, k, v, table, at)
    with dispatch.kernels("native"):
        got = jax.jit(lambda *a: dispatch.paged_attention(*a))(verify, k, v, table, at)
    assert got.shape == (rows, tokens, *q.shape[2:])
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)


def test_each_device_attends_with_its_own_heads_under_a_mesh():
    q, k, v, table, positions = case(jnp.float32, 2, 3, 64)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    want = paged_attention_reference(q, k, v, table, positions)
    heads, whole = NamedSharding(mesh, P(None, None, "tp")), NamedSharding(mesh, P())
    q, k, v = (jax.device_put(a, heads) for a in (q, k, v))
    table, positions = jax.device_put((table, positions), whole)
    with dispatch.kernels("native"), head_parallel.across(mesh):
        attend = jax.jit(lambda *a: dispatch.paged_attention(*a))
        text = attend.lower(q, k, v, table, positions).compile().as_text()
        got = attend(q, k, v, table, positions)
    assert "flipjax_paged_decode" in text and "all-gather" not in text
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)
