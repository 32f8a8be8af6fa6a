"""The native matmul's row counts are chosen on each machine by timing it against XLA's dot:
the choice follows the times, a vocabulary-wide weight has its own, it is measured once per
build and then read from the cache, is
measured again where the cached file cannot be trusted, runs even when first asked while a step
is being traced, and can be set by `FLIPJAX_NATIVE_MATMUL_ROWS`, refused by name when it cannot
be read.

The suite pins the choice (tests/conftest.py) so that every machine routes the same products
to the kernel; the tests here unset it.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from flipjax.model.layers import Linear
from kernels_pallas import cpu_caches, dispatch, head_parallel, native
from kernels_pallas.matmul import calibration
from tests.support.calibrations import fresh_calibration, small_measure

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
REAL_MEASURE = calibration.measure  # the fixture below replaces it


def _times(ratios: dict[int, float]) -> dict[int, tuple[float, float]]:
    """Times where the kernel takes `ratio` of XLA's time at each row count."""
    return {rows: (ratio * 1e-3, 1e-3) for rows, ratio in ratios.items()}


def test_the_choice_is_the_run_of_row_counts_where_the_kernel_saves_most():
    times = {
        "float32": _times({1: 1.1, 2: 0.5, 4: 0.5, 8: 0.6, 16: 0.8, 32: 0.9, 48: 1.2, 64: 1.4}),
        # AVX2-like: the kernel loses from 16 rows; a loss at 2 smaller than its neighbours'
        # gains is noise and is bridged.
        "bfloat16": _times({1: 0.4, 2: 1.05, 4: 0.5, 8: 0.7, 16: 1.3, 32: 1.6}),
    }
    assert calibration.choose(times) == {"float32": range(2, 33), "bfloat16": range(1, 9)}
    never = {"float32": _times({1: 1.2, 8: 1.01}), "bfloat16": _times({1: 2.0})}
    assert calibration.choose(never) == {"float32": range(0), "bfloat16": range(0)}


def test_a_tie_at_either_end_of_the_run_joins_it():
    """One row is a matvec either way, bound by reading the weight: the two tie there, and
    which wins the calibration is noise (1.3% on a run that picked XLA, whose steps then took
    9% longer). A tie joins the kernel's run, a loss beyond the margin does not."""
    times = {
        "float32": _times({1: 1.02, 2: 0.5, 4: 0.6, 8: 1.025, 16: 1.1}),
        "bfloat16": _times({1: 1.05, 2: 0.5, 4: 1.04}),
    }
    assert calibration.choose(times) == {"float32": range(1, 9), "bfloat16": range(2, 3)}
    ties_only = {"float32": _times({1: 1.01, 8: 1.0}), "bfloat16": _times({1: 1.02})}
    assert calibration.choose(ties_only) == {"float32": range(0), "bfloat16": range(0)}


@pytest.fixture()
def unpinned(tmp_path, monkeypatch):
    """No choice set by the variable, and a fresh cache whose calibrations are counted."""

    def times() -> calibration.Times:
        return {
            "float32": _times({1: 1.1, 2: 0.5, 4: 0.6, 8: 1.2}),
            "bfloat16": _times({1: 0.5, 2: 1.5}),
            # An lm head: the kernel loses from 4 rows (an AVX2 build's, measured, from 16).
            "float32:wide": _times({1: 1.1, 2: 0.5, 4: 1.3, 8: 1.4}),
            "bfloat16:wide": _times({1: 1.5, 2: 1.5}),
        }

    yield from fresh_calibration(tmp_path, monkeypatch, times)


def test_it_is_measured_once_per_build_then_read_from_the_cache(unpinned):
    assert calibration.native_rows(F32, "native") == range(2, 5)
    assert calibration.native_rows(BF16, "native") == range(1, 2)
    assert unpinned == ["native"]
    calibration._calibrated.cache_clear()  # a new process
    assert calibration.native_rows(F32, "native") == range(2, 5)
    assert unpinned == ["native"]  # read, not measured
    path = native.cached_beside("matmul", "native", calibration.CACHE_SUFFIX)
    assert json.loads(path.read_text())["rows"] == {
        "float32": [2, 4],
        "bfloat16": [1, 1],
        "float32:wide": [2, 2],
        "bfloat16:wide": None,
    }
    assert os.stat(path).st_mode & 0o077 == 0
    calibration.native_rows(F32, "x86-64-v3")  # another build is measured on its own
    assert unpinned == ["native", "x86-64-v3"]


def test_a_weight_as_wide_as_a_vocabulary_takes_the_wide_choice(unpinned):
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    wide = calibration.WIDE_COLUMNS
    assert calibration.native_rows(F32, "native", columns=wide) == range(2, 3)
    assert calibration.native_rows(F32, "native", columns=wide - 1) == range(2, 5)
    assert calibration.native_rows(BF16, "native", columns=32000) == range(0)
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(4, 2048, F32) is not None
        assert dispatch.matmul(4, 32000, F32) is None  # the lm head: XLA's dot
        assert dispatch.matmul(2, 32000, F32) is not None


@pytest.mark.parametrize(
    "damage",
    [
        "not json",
        '{"rows": {"float32": [4, 2], "bfloat16": null}}',
        # A choice cached before wide weights had their own: measured again, wide weights too.
        '{"rows": {"float32": [2, 4], "bfloat16": [1, 1]}}',
        # A choice cached before a narrower build was timed beside the build's own.
        '{"rows": {"float32": [2, 4], "bfloat16": [1, 1], "float32:wide": [2, 2], '
        '"bfloat16:wide": null}}',
        "others can write",
    ],
)
def test_a_cached_choice_that_cannot_be_trusted_is_measured_again(unpinned, caplog, damage):
    calibration.native_rows(F32, "native")
    path = native.cached_beside("matmul", "native", calibration.CACHE_SUFFIX)
    if damage == "others can write":
        os.chmod(path, 0o666)
    else:
        path.write_text(damage)
    calibration._calibrated.cache_clear()
    with caplog.at_level(logging.WARNING, logger=calibration.__name__):
        assert calibration.native_rows(F32, "native") == range(2, 5)
    assert unpinned == ["native", "native"]
    assert f"{path} " in caplog.text and "measuring again" in caplog.text
    assert calibration.load(path).rows == {
        "float32": range(2, 5),
        "bfloat16": range(1, 2),
        "float32:wide": range(2, 3),
        "bfloat16:wide": range(0),
    }
    assert os.stat(path).st_mode & 0o077 == 0


def test_the_variable_sets_the_choice_and_a_bad_one_is_refused_by_name(monkeypatch):
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    monkeypatch.setenv(calibration.ROWS_ENV, "float32=1-64")
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(1, 768, F32) is not None and dispatch.matmul(64, 768, F32)
        assert dispatch.matmul(64, 32000, F32) is not None  # for weights of every width
        assert dispatch.matmul(65, 768, F32) is None
        assert dispatch.matmul(2, 768, BF16) is None  # left out: XLA's dot
    monkeypatch.setenv(calibration.ROWS_ENV, "none")
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(4, 768, F32) is None
    for bad in ("float32=8-2", "float32=2-32,float32=1-4", "fp32=2-32", "float32=two-32"):
        monkeypatch.setenv(calibration.ROWS_ENV, bad)
        with pytest.raises(ValueError, match=calibration.ROWS_ENV):
            calibration.native_rows(F32)


def test_a_real_calibration_runs_while_a_step_is_traced(unpinned, monkeypatch):
    """The first use is at trace time; the timed products must run, not join the trace."""
    monkeypatch.setattr(calibration, "measure", small_measure)
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    lin = Linear(256, 512, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 256), jnp.float32)
    with dispatch.kernels("native"), head_parallel.across(one):
        program = jax.jit(lin.__call__).lower(x).as_text()
    path = native.cached_beside("matmul", native.build_isa(), calibration.CACHE_SUFFIX)
    seconds = json.loads(path.read_text())["seconds"]
    int8 = {calibration.INT8} if calibration.narrower_build(native.build_isa()) else set()
    assert set(seconds) == set(calibration.KEYS) | int8
    assert all(t > 0 for d in seconds.values() for pair in d.values() for t in pair)
    chosen = calibration.native_rows(F32)
    assert ("flipjax_matmul" in program) == (2 in chosen)


def test_the_calibration_times_products_over_copies_spanning_the_cache(monkeypatch):
    """On a CPU whose cache holds the sweep, the calibration would time the cache, not memory
    as a decode step reads it: the default sweep follows the cache this CPU reports."""
    monkeypatch.setattr(cpu_caches, "last_level_cache_bytes", lambda: 40 << 20)
    spans = []
    real_pass = calibration._timed_pass

    def counting_pass(product, weights):
        arrays = jax.tree.leaves(weights)  # a pair of projections per copy, or one weight
        spans.append(sum(w.nbytes for w in arrays))
        assert len({w.unsafe_buffer_pointer() for w in arrays}) == len(arrays)
        return real_pass(product, weights[:2])

    monkeypatch.setattr(calibration, "_timed_pass", counting_pass)
    REAL_MEASURE(native.build_isa(), rows=(2,), shape=(512, 1024), rounds=1, wide_shape=(512, 2048))
    assert spans and all(span >= 80 << 20 for span in spans), spans


def test_a_layers_projections_are_timed_in_one_call_as_the_layer_runs_them(monkeypatch):
    """Mid-size weights are timed as a layer's two projections from one input: the kernel's one
    call for both (`matmuls`) against XLA's dot for each, as `Linear` runs them on either path;
    a vocabulary-wide weight, an lm head, alone."""
    monkeypatch.setattr(calibration, "narrower_build", lambda isa: None)
    programs = []
    real_pass = calibration._timed_pass

    def recording_pass(product, weights):
        text = jax.jit(product).lower(weights[0]).as_text()
        programs.append((len(jax.tree.leaves(weights[0])), text))
        return real_pass(product, weights[:2])

    monkeypatch.setattr(calibration, "_timed_pass", recording_pass)
    REAL_MEASURE(native.build_isa(), rows=(2,), shape=(64, 256), rounds=1, wide_shape=(64, 512))
    kernel, xla = programs[0::2], programs[1::2]  # each row count: the kernel's pass, XLA's
    assert [n for n, _ in kernel] == [2, 2, 1, 1]  # float32, bfloat16, then their wide weights
    assert all(("flipjax_matmuls" in text) == (n == 2) for n, text in kernel)
    assert all("flipjax_matmul" in text for _, text in kernel)
    assert all(text.count("dot_general") == n and "flipjax" not in text for n, text in xla)
