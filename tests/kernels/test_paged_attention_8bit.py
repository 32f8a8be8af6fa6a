"""8-bit KV pages (int8, float8_e4m3fn) with a float32 scale per page and kv head: the reference
against plain float64 attention over the dequantized pool in numpy, the Pallas kernel
(interpret mode) against the reference, and the refusals of a page/scale mismatch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.pallas_kernel import ragged_paged_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference
from tests.support.kernel_cases import paged_case

QMAX = {jnp.int8: 127.0, jnp.float8_e4m3fn: 448.0}
PAGE_SIZE = 4
# A prefill chunk crossing pages (positions 3..9), decode rows at a page's last and first
# slots, and a padding row; group 2 over 2 kv heads.
ROWS = [(10, 7), (4, 1), (9, 1), (0, 0)]


def quantize(x: np.ndarray, dtype: jnp.dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """x [P, S, Hkv, D] -> 8-bit pages and float32 scales [P, Hkv]: max |x| over the page's
    slots of each head, over the format's largest value."""
    scale = np.abs(x).max(axis=(1, 3)) / QMAX[dtype]
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    scaled = x / scale[:, None, :, None]
    if dtype == jnp.int8:
        pages = jnp.asarray(np.clip(np.round(scaled), -127, 127).astype(np.int8))
    else:
        pages = jnp.asarray(np.clip(scaled, -448, 448), jnp.float32).astype(jnp.float8_e4m3fn)
    return pages, jnp.asarray(scale)


def case_8bit(dtype: jnp.dtype, seed: int = 0) -> tuple:
    q, k, v, table, positions = paged_case(seed, ROWS, 2, 2, PAGE_SIZE, jnp.float32)
    rng = np.random.default_rng(seed + 1)

    # Magnitudes differing by page and head make scales differ, so a scale taken from the
    # wrong page or head changes the result well past the tolerances.
    def spread(x: jnp.ndarray) -> np.ndarray:
        return np.asarray(x) * rng.uniform(0.1, 4.0, (x.shape[0], 1, x.shape[2], 1))

    k8, k_scale = quantize(spread(k), dtype)
    v8, v_scale = quantize(spread(v), dtype)
    return q, k8, v8, table, positions, k_scale, v_scale


def attend(form: str, q, k, v, table, positions, **scales) -> jnp.ndarray:
    if form == "reference":
        return paged_attention_reference(q, k, v, table, positions, **scales)
    return ragged_paged_attention(q, k, v, table, positions, interpret=True, **scales)


def numpy_attention(q, k8, v8, table, positions, k_scale, v_scale) -> np.ndarray:
    """Dequantize the whole pool in float64, then masked softmax attention per row and token."""
    k = np.asarray(k8.astype(jnp.float32), np.float64) * np.asarray(k_scale)[:, None, :, None]
    v = np.asarray(v8.astype(jnp.float32), np.float64) * np.asarray(v_scale)[:, None, :, None]
    q, table, positions = (np.asarray(a) for a in (q, table, positions))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            pos = positions[bi, ti]
            if pos < 0:
                continue
            slots = np.arange(pos + 1)
            pages = table[bi, slots // PAGE_SIZE]
            keys, values = k[pages, slots % PAGE_SIZE], v[pages, slots % PAGE_SIZE]  # [S, Hkv, D]
            for hi in range(h):
                scores = keys[:, hi // g] @ q[bi, ti, hi].astype(np.float64) / np.sqrt(d)
                weights = np.exp(scores - scores.max())
                out[bi, ti, hi] = weights @ values[:, hi // g] / weights.sum()
    return out


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_reference_matches_float64_attention_over_dequantized_pool(dtype):
    q, k8, v8, table, positions, k_scale, v_scale = case_8bit(dtype)
    assert k8.dtype == dtype and k_scale.shape == (k8.shape[0], 2)
    want = numpy_attention(q, k8, v8, table, positions, k_scale, v_scale)
    got = paged_attention_reference(
        q, k8, v8, table, positions, 2, k_scale=k_scale, v_scale=v_scale
    )
    valid = np.asarray(positions >= 0)
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("kv_splits", "pages_per_block"), [(1, 2), (2, 1)])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_kernel_matches_reference(dtype, kv_splits, pages_per_block):
    q, k8, v8, table, positions, k_scale, v_scale = case_8bit(dtype, seed=kv_splits)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    # The reference walks other blocks (3 pages) than the kernel, so neither's blocking hides.
    want = paged_attention_reference(q, k8, v8, table, positions, 3, **scales)
    options = dict(kv_splits=kv_splits, pages_per_block=pages_per_block, **scales)
    got = ragged_paged_attention(q, k8, v8, table, positions, interpret=True, **options)
    valid = np.asarray(positions >= 0)
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-5, rtol=0)
    assert np.all(got[~valid] == 0), "padding rows must come out as zeros"


@pytest.mark.parametrize("form", ["reference", "kernel"])
def test_no_dequantized_copy_of_the_pool(form):
    """Both forms widen a gathered block at a time: no float array of the pool's shape (or of
    one kv head's pages) appears anywhere in the traced program, the kernel's body included."""
    q, k8, v8, table, positions, k_scale, v_scale = case_8bit(jnp.int8)

    def traced(k, v, ks, vs):
        return attend(form, q, k, v, table, positions, k_scale=ks, v_scale=vs)

    program = str(jax.make_jaxpr(traced)(k8, v8, k_scale, v_scale))

    def shapes(kind: str) -> set[tuple[int, ...]]:
        return {
            tuple(map(int, dims.split(","))) for dims in re.findall(kind + r"\[([\d,]+)\]", program)
        }

    p, s, hkv, d = k8.shape
    assert k8.shape in shapes("i8")  # the search does see the pool's shapes
    assert not shapes("(?:f32|bf16|f16)") & {(p, s, hkv, d), (p, s, d)}


@pytest.mark.parametrize("form", ["reference", "kernel"])
def test_page_scale_mismatches_are_refused(form):
    q, k8, v8, table, positions, k_scale, v_scale = case_8bit(jnp.int8)
    _, kf, vf, *_ = paged_case(0, ROWS, 2, 2, PAGE_SIZE, jnp.float32)

    def call(k, v, **scales):
        return attend(form, q, k, v, table, positions, **scales)

    with pytest.raises(ValueError, match="k pages are int8 and need k_scale"):
        call(k8, v8)
    with pytest.raises(ValueError, match="v pages are int8 and need v_scale"):
        call(k8, v8, k_scale=k_scale)
    with pytest.raises(ValueError, match="k_scale given for float32 k pages"):
        call(kf, vf, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="v_scale is float32 \\(2, 2\\), want float32"):
        call(k8, v8, k_scale=k_scale, v_scale=v_scale[:2])
    with pytest.raises(ValueError, match="k_scale is bfloat16"):
        call(k8, v8, k_scale=k_scale.astype(jnp.bfloat16), v_scale=v_scale)
