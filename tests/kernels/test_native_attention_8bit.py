"""The native decode attention kernel over 8-bit K/V pages (int8 and float8_e4m3fn, one float32
scale per page and KV head), against attention computed here in float64 numpy over the values
the pages and scales stand for.

The pages are quantized here too, as flipjax stores them: per page and KV head the scale is the
largest magnitude over the page's slots divided by the format's largest value (127 for int8,
rounded and clipped; 448 for fp8, clipped, then cast). Each page and head is given a magnitude of
its own, so a scale read from the wrong page or head moves the result far from the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import native
from kernels_pallas.paged_attention import native_binding as attention_native

PAGES, PAGE, WIDTH = 64, 16, 12
# A first page, a page's last slot, the next page's first, deep in the table, and padding.
POSITIONS = [0, 15, 16, 150, -1]
INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)


def quantize(x: np.ndarray, dtype: jnp.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Pages x [P, S, Hkv, D] as `dtype` and their float32 scales [P, Hkv]."""
    qmax = 127.0 if dtype == INT8 else 448.0
    scale = (np.abs(x).max(axis=(1, 3)) / qmax).astype(np.float32)
    y = x / np.where(scale == 0, 1, scale)[:, None, :, None]
    if dtype == INT8:
        return np.clip(np.round(y), -127, 127).astype(np.int8), scale
    return np.clip(y, -448, 448).astype(jnp.float8_e4m3fn), scale


def dequantized(pages: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return pages.astype(np.float64) * scale.astype(np.float64)[:, None, :, None]


def attention(q, k, v, table, positions) -> np.ndarray:
    """Decode attention in float64 over float K/V pages: out [B, H, D] for q [B, H, D] (zero
    for a padding row)."""
    rows, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros((rows, heads, dim))
    for b, pos in enumerate(positions):
        if pos < 0:
            continue
        j = np.arange(pos + 1)
        pages, slots = table[b, j // PAGE], j % PAGE
        for h in range(heads):
            keys, values = k[pages, slots, h // group], v[pages, slots, h // group]
            scores = keys @ q[b, h].astype(np.float64) / np.sqrt(dim)
            p = np.exp(scores - scores.max())
            out[b, h] = p @ values / p.sum()
    return out


def case(dtype: jnp.dtype, kv_heads: int, group: int, dim: int, seed: int = 0):
    """q, quantized k and v pages with their scales, the page table and positions."""
    rng = np.random.default_rng(seed)
    rows = len(POSITIONS)
    # A magnitude per page and head, a factor of up to e^3 apart.
    spread = np.exp(rng.uniform(-1.5, 1.5, size=(2, PAGES, 1, kv_heads, 1)))
    k, ks = quantize(rng.normal(size=(PAGES, PAGE, kv_heads, dim)) * spread[0], dtype)
    v, vs = quantize(rng.normal(size=(PAGES, PAGE, kv_heads, dim)) * spread[1], dtype)
    q = rng.normal(size=(rows, kv_heads * group, dim)).astype(np.float32)
    table = rng.permutation(PAGES)[: rows * WIDTH].reshape(rows, WIDTH).astype(np.int32)
    return q, k, v, ks, vs, table, np.asarray(POSITIONS, np.int32)


def run(q, k, v, ks, vs, table, positions) -> np.ndarray:
    out = jax.jit(attention_native.decode)(
        jnp.asarray(q)[:, None], k, v, table, jnp.asarray(positions)[:, None], ks, vs
    )
    assert out.shape == (q.shape[0], 1, *q.shape[1:]) and out.dtype == jnp.float32
    return np.asarray(out[:, 0])


def check(got, q, k, v, ks, vs, table, positions):
    want = attention(q, dequantized(k, ks), dequantized(v, vs), table, positions)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(got[positions < 0]), "a padding row's output is zero"


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=str)
@pytest.mark.parametrize(
    "kv_heads,group,dim",
    [
        (2, 3, 40),  # a head size that is no whole number of vectors
        (1, 4, 64),
    ],
)
def test_decode_is_attention_over_the_dequantized_pages(dtype, kv_heads, group, dim):
    data = case(dtype, kv_heads, group, dim)
    check(run(*data), *data)


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=str)
def test_every_8bit_value_widens_exactly(dtype):
    """One position (its probability is exactly 1) whose value row holds every code of the
    format (fp8's two NaNs, never written, left out), under power-of-two scales per head: the
    output is each value times its head's scale, exactly."""
    codes = np.arange(256, dtype=np.uint8)
    if dtype == FP8:
        codes = codes[(codes & 0x7F) != 0x7F]
    values = codes.view(np.int8 if dtype == INT8 else jnp.float8_e4m3fn)
    dim = len(values)
    v = np.zeros((2, PAGE, 2, dim), values.dtype)
    v[1, 0, 0], v[1, 0, 1] = values, values[::-1]
    k = v.copy()
    vs = np.array([[1.0, 1.0], [0.5, 4.0]], np.float32)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 4, dim)).astype(np.float32)
    got = run(q, k, v, vs, vs, np.array([[1]], np.int32), np.array([0], np.int32))
    widened = values.astype(np.float32)
    np.testing.assert_array_equal(got[0, :2], np.stack([widened * 0.5] * 2))
    np.testing.assert_array_equal(got[0, 2:], np.stack([widened[::-1] * 4.0] * 2))


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=str)
def test_a_page_of_scale_zero_contributes_exact_zeros(dtype):
    """An empty page (scale 0) stands for zeros whatever its bytes hold: a row wholly on one
    attends to zeros (output exactly zero), and one elsewhere in a row is zero keys and values."""
    q, k, v, ks, vs, table, positions = case(dtype, 2, 3, 40, seed=2)
    empty = [table[0, 0], table[3, 4]]  # row 0 (position 0) lives on its first page alone
    ks[empty], vs[empty] = 0.0, 0.0
    got = run(q, k, v, ks, vs, table, positions)
    assert np.all(got[0] == 0.0)
    check(got, q, k, v, ks, vs, table, positions)


def test_the_kernel_takes_8bit_pages():
    assert {INT8, FP8} <= set(attention_native.HANDLERS)


def test_missing_or_misshapen_scales_are_refused_by_name():
    q, k, v, ks, vs, table, positions = case(INT8, 2, 3, 40)
    q, positions = q[:, None], positions[:, None]
    decode = attention_native.decode
    with pytest.raises(ValueError, match="v pages are int8 and need v_scale"):
        decode(q, k, v, table, positions, ks)
    k8, v8 = k.astype(FP8), v.astype(FP8)
    with pytest.raises(ValueError, match="k pages are float8_e4m3fn and need k_scale"):
        decode(q, k8, v8, table, positions)
    with pytest.raises(ValueError, match="k_scale given for float32 k pages"):
        decode(q, k.astype(np.float32), v.astype(np.float32), table, positions, ks, vs)
    with pytest.raises(ValueError, match=r"v_scale is float32 \(2, 64\), want float32 \(64, 2\)"):
        decode(q, k, v, table, positions, ks, vs.T)
    with pytest.raises(ValueError, match="K and V pages must be one of .*got int8 and float8"):
        decode(q, k, v8, table, positions, ks, vs)


def test_the_kernel_itself_refuses_misshapen_scales_and_other_pages():
    """What the binding checks, the handler checks again for callers that go around it."""
    q, k, v, ks, vs, table, positions = case(INT8, 2, 3, 40)

    def call(kernel, *pages_and_scales):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        handler = jax.ffi.ffi_call(native.target(kernel), out)
        return jax.block_until_ready(handler(q, *pages_and_scales, table, positions))

    with pytest.raises(Exception, match=r"k_scale and v_scale must be f32\[P, Hkv\] = \[64, 2\]"):
        call("paged_decode_int8", k, v, ks[:-1], vs[:-1])
    with pytest.raises(Exception, match="takes K and V pages of float8_e4m3fn"):
        call("paged_decode_fp8", k, v, ks, vs)
