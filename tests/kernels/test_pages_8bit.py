"""Writing K/V into 8-bit pages (`kernels_pallas/paged_attention/pages.py`): a page's scale is
its tokens' largest magnitude over the format's largest value, whatever steps brought the
tokens; what a page held is re-rounded when its scale grows; a page written from its first slot
starts afresh (a recycled page's old scale is its previous owner's). Checked against numpy on
the written tokens, not against the code's own quantizer, by the in-place native writer and by
XLA's scatter alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.pages import scatter_rows, write_pages
from kernels_pallas.paged_attention.write_binding import write_rows

PAGES, PAGE, HEADS, DIM = 8, 4, 2, 8
TOP = {jnp.int8: 127.0, jnp.float8_e4m3fn: 448.0}
# Each token a different magnitude, so the page's scale grows within it.
TOKENS = (
    np.random.default_rng(0).normal(size=(1, 10, HEADS, DIM))
    * np.linspace(0.5, 3, 10)[None, :, None, None]
)
TABLE = jnp.asarray([[3, 5, 1]], jnp.int32)  # positions 0-3 in page 3, 4-7 in 5, 8-9 in 1


def run(dtype, chunks: list[int], writer, pages=None, scales=None):
    pages = jnp.zeros((PAGES, PAGE, HEADS, DIM), dtype) if pages is None else pages
    scales = jnp.zeros((PAGES, HEADS), jnp.float32) if scales is None else scales
    write = jax.jit(lambda *a: write_pages(*a, writer=writer))
    start = 0
    for n in chunks:
        x = jnp.asarray(TOKENS[:, start : start + n], jnp.float32)
        pos = jnp.arange(start, start + n, dtype=jnp.int32)[None]
        pages, _, scales, _ = write(pages, pages, x, x, TABLE, pos, scales, scales)
        start += n
    return pages, scales


def held(pages, scales) -> np.ndarray:
    """The tokens the pages hold, dequantized, in position order."""
    values = np.asarray(pages.astype(jnp.float32)) * np.asarray(scales)[:, None, :, None]
    return np.concatenate([values[3], values[5], values[1][:2]])


@pytest.mark.parametrize("writer", [scatter_rows, write_rows], ids=["xla", "native"])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_pages_scale_is_its_tokens_peak_however_they_arrived(dtype, writer):
    peaks = np.abs(TOKENS[0]).max(axis=-1)  # [token, head]
    want = np.stack([peaks[0:4].max(0), peaks[4:8].max(0), peaks[8:10].max(0)]) / TOP[dtype]
    whole = run(dtype, [10], writer)
    for chunks in ([1] * 10, [3, 4, 3]):
        pages, scales = run(dtype, chunks, writer)
        np.testing.assert_allclose(np.asarray(scales)[[3, 5, 1]], want, rtol=1e-6)
        np.testing.assert_array_equal(scales, whole[1])
        # Rounded to the page's scale (twice at most per growth, for an earlier token): within
        # a step of the format at the page's peak.
        # The format's spacing at its top, in scales: int8 1, fp8 e4m3 32 (256..448 step 32).
        step = want.max() * (1.0 if dtype == jnp.int8 else 32.0)
        err = np.abs(held(pages, scales) - TOKENS[0])
        assert err.max() <= step, (chunks, err.max(), step)
    assert not np.any(np.asarray(whole[1])[[0, 2, 4, 6, 7]]), "untouched pages keep scale 0"


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_recycled_page_starts_afresh_and_a_continued_one_does_not(dtype):
    # The pages held another request's tokens, 100 times larger: scales far above these.
    old = jnp.full((PAGES, PAGE, HEADS, DIM), 7, dtype)
    loud = jnp.full((PAGES, HEADS), 300.0 / TOP[dtype], jnp.float32)
    pages, scales = run(dtype, [10], write_rows, old, loud)
    fresh = run(dtype, [10], write_rows)
    written = jnp.isin(jnp.arange(PAGES), TABLE)[:, None]
    np.testing.assert_array_equal(scales, jnp.where(written, fresh[1], loud))
    np.testing.assert_array_equal(held(pages, scales), held(*fresh))


def test_float_pages_take_no_scales_and_8bit_ones_need_them():
    x = jnp.zeros((1, 1, HEADS, DIM), jnp.float32)
    pos = jnp.zeros((1, 1), jnp.int32)
    float_pages = jnp.zeros((PAGES, PAGE, HEADS, DIM), jnp.bfloat16)
    scales = jnp.zeros((PAGES, HEADS), jnp.float32)
    with pytest.raises(ValueError, match="need scales exactly when they are 8-bit"):
        write_pages(float_pages, float_pages, x, x, TABLE, pos, scales, scales)
    int8_pages = float_pages.astype(jnp.int8)
    with pytest.raises(ValueError, match="need scales exactly when they are 8-bit"):
        write_pages(int8_pages, int8_pages, x, x, TABLE, pos)
