"""The native in-place row write (`kernels_pallas/paged_attention/page_writes.cc`) against XLA's
scatter `pool.at[ids].set(rows, mode="drop")`, bit for bit, and its reason to exist: with the
pool donated it writes into the pool's own buffer, where XLA:CPU's scatter into a bfloat16 or
float8 pool converts the whole pool to float32 and back. A negative id is dropped, as the
scatter drops it with `wrap_negative_indices=False` (by default jnp counts it from the end).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import native
from kernels_pallas.paged_attention.write_binding import write_rows

DTYPES = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8, jnp.float32]
# In range (first and last row among them), then out of range on both sides: dropped.
IDS = [0, 5, 11, -1, 12, 3, -7, 40]


def scatter(pool, rows, ids):
    return pool.at[ids].set(rows.astype(pool.dtype), mode="drop", wrap_negative_indices=False)


def case(dtype, row: tuple[int, ...], seed: int = 0):
    rng = np.random.default_rng(seed)
    a, n = 12, len(IDS)
    pool = jnp.asarray(rng.normal(size=(a, *row)) * 8, dtype)
    # Given as float32, so that the cast to the pool's dtype is the binding's.
    rows = jnp.asarray(rng.normal(size=(n, *row)) * 8, jnp.float32)
    return pool, rows, jnp.asarray(IDS, jnp.int32)


def bits(x: jax.Array) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


def sequential(pool, rows, ids) -> np.ndarray:
    """The rows written one after another in numpy, out-of-range ids skipped: the bits."""
    shape = bits(pool).shape
    out = bits(pool).reshape(pool.shape[0], -1).copy()
    rows = bits(rows.astype(pool.dtype)).reshape(rows.shape[0], -1)
    for i, at in enumerate(np.asarray(ids).tolist()):
        if 0 <= at < pool.shape[0]:
            out[at] = rows[i]
    return out.reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("row", [(), (3,), (4, 2, 8)], ids=str)
def test_write_is_the_scatter(dtype, row):
    pool, rows, ids = case(dtype, row)
    got = jax.jit(write_rows)(pool, rows, ids)
    want = jax.jit(scatter)(pool, rows, ids)
    assert got.shape == pool.shape and got.dtype == pool.dtype
    np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(got), sequential(pool, rows, ids))
    assert not np.array_equal(bits(got), bits(pool)), "rows were written"


def test_the_last_of_duplicate_ids_wins():
    pool, rows, _ = case(jnp.bfloat16, (3,))
    ids = jnp.asarray([2, 7, 2, 2, 7, 1, 9, 4], jnp.int32)
    np.testing.assert_array_equal(
        bits(jax.jit(write_rows)(pool, rows, ids)), sequential(pool, rows, ids)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_token_rows_go_to_slots_of_a_page_pool(dtype):
    """Rows [N, H, D] into a pool [P, S, H, D] at slot ids page * S + offset: the scatter of
    the flattened pool, without the pool reshaped."""
    pool, rows, ids = case(dtype, (4, 2, 8))
    pages = pool[:, 0].reshape(3, 4, 2, 8)  # 12 slots as 3 pages of 4
    got = jax.jit(write_rows)(pages, rows[:, 0], ids)
    want = scatter(pool[:, 0], rows[:, 0], ids).reshape(3, 4, 2, 8)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("token_rows", [False, True], ids=["pages", "token rows"])
def test_a_donated_pool_is_written_in_place(dtype, token_rows):
    # XLA's scatter held twice the pool's bytes in temporaries here, for bfloat16 and float8;
    # and a reshaped pool (token rows into the flat slots) is copied before a custom call.
    pool = jnp.zeros((1024, 16, 2, 64), dtype)
    rows = jnp.ones((4, 16, 2, 64), jnp.float32)
    ids = jnp.asarray([3, 1023, -1, 1024], jnp.int32)
    if token_rows:
        rows, ids = rows[:, 0], ids * 16
    step = jax.jit(write_rows, donate_argnums=0)
    memory = step.lower(pool, rows, ids).compile().memory_analysis()
    # Room for the rows cast to the pool's dtype, nothing of the pool's size.
    cast = rows.size * pool.dtype.itemsize
    assert memory.temp_size_in_bytes <= cast + 1024 < pool.nbytes // 16
    assert memory.alias_size_in_bytes == pool.nbytes
    where = pool.unsafe_buffer_pointer()
    out = step(pool, rows, ids)
    assert out.unsafe_buffer_pointer() == where, "the result is the pool's own buffer"
    assert pool.is_deleted()
    written = np.asarray(out[jnp.asarray([3, 1023])], np.float32)
    if token_rows:
        written = written[:, 0]
    assert np.all(written == 1) and float(jnp.abs(out.astype(jnp.float32)).sum()) == written.size


def test_a_pool_not_donated_is_left_as_it_was():
    pool, rows, ids = case(jnp.bfloat16, (4, 2, 8))
    before = bits(pool).copy()
    want = bits(scatter(pool, rows, ids))

    # The pool read again after the write, in the same program: XLA copies it for the write.
    def twice(pool, rows, ids):
        return write_rows(pool, rows, ids), write_rows(pool, -rows, ids), pool

    first, second, same = jax.jit(twice)(pool, rows, ids)
    np.testing.assert_array_equal(bits(first), want)
    np.testing.assert_array_equal(bits(second), bits(scatter(pool, -rows, ids)))
    np.testing.assert_array_equal(bits(same), before)
    np.testing.assert_array_equal(bits(write_rows(pool, rows, ids)), want)  # eagerly
    np.testing.assert_array_equal(bits(pool), before)


def test_wide_ids_out_of_int32_range_are_dropped():
    """Not wrapped into range: jnp's own scatter casts int64 ids to int32 first, so there
    2**32 + 1 writes row 1."""
    pool, rows, _ = case(jnp.int8, (3,))
    ids = [2**32 + 1, 2, -(2**32) + 3, 2**31, 5, 0, 2**63 - 1, 4]
    with jax.enable_x64(True):
        got = jax.jit(write_rows)(pool, rows, jnp.asarray(ids, jnp.int64))
        got_unsigned = jax.jit(write_rows)(pool, rows, jnp.asarray(ids[:2] * 4, jnp.uint64))
    np.testing.assert_array_equal(bits(got), sequential(pool, rows, ids))
    np.testing.assert_array_equal(bits(got_unsigned), sequential(pool, rows, ids[:2] * 4))


@pytest.mark.parametrize(
    "pool,rows,ids,words",
    [
        ((12, 3), (8, 4), (8,), "rows \\[8, 4\\]"),
        ((12, 3), (8, 3, 1), (8,), "rows \\[8, 3, 1\\]"),
        ((12, 3), (8, 3), (7,), "ids \\[7\\]"),
        ((12, 3), (8, 3), (8, 1), "ids \\[8, 1\\]"),
        ((), (8,), (8,), "pool \\[\\]"),
    ],
)
def test_shapes_that_do_not_fit_are_refused(pool, rows, ids, words):
    with pytest.raises(ValueError, match=f"write rows: need pool .*{words}"):
        write_rows(jnp.zeros(pool, jnp.bfloat16), jnp.zeros(rows), jnp.zeros(ids, jnp.int32))


def test_other_refusals():
    pool, rows = jnp.zeros((12, 3), jnp.bfloat16), jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="ids must be integers"):
        write_rows(pool, rows, jnp.zeros(2))
    with pytest.raises(ValueError, match="below a byte"):
        write_rows(jnp.zeros((12, 3), jnp.int4), rows, jnp.zeros(2, jnp.int32))


@pytest.mark.parametrize(
    "rows,ids,words",
    [
        (((2, 3), jnp.float32), [0, 1], "rows must have the pool's dtype"),
        (((2, 4), jnp.bfloat16), [0, 1], "got pool \\[12, 3\\], rows \\[2, 4\\]"),
        (((2, 3), jnp.bfloat16), [0, 1, 2], "and ids \\[3\\]"),
    ],
)
def test_the_kernel_refuses_what_the_binding_would(rows, ids, words):
    """Called past the binding's checks, the kernel refuses rather than reads out of bounds."""
    pool = jnp.zeros((12, 3), jnp.bfloat16)
    call = jax.ffi.ffi_call(
        native.target("write_rows"), jax.ShapeDtypeStruct(pool.shape, pool.dtype)
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"write rows: .*{words}"):
        call(pool, jnp.zeros(*rows), jnp.asarray(ids, jnp.int32)).block_until_ready()


def test_a_result_not_aliased_to_the_pool_is_still_the_pool_written():
    """Without `input_output_aliases` the result is a buffer of its own, which the kernel fills
    from the pool first (a binding always aliases; this keeps the kernel's guard honest)."""
    pool, rows, ids = case(jnp.bfloat16, (3,))
    call = jax.ffi.ffi_call(
        native.target("write_rows"), jax.ShapeDtypeStruct(pool.shape, pool.dtype)
    )
    got = jax.jit(call)(pool, rows.astype(pool.dtype), ids)
    np.testing.assert_array_equal(bits(got), sequential(pool, rows, ids))
