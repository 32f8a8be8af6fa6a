"""A build of AVX-512 kernels times the AVX2 build's matmul beside its own, and runs it at the
row counts where it was faster by more than a tie: the narrower build is chosen only where it
gives the same bits, the choice is cached with the rest of the calibration, the dispatch of
a decode step's products follows it, and `FLIPJAX_NATIVE_MATMUL_ROWS` keeps every product on
the build's own kernel.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas import dispatch, head_parallel, native
from kernels_pallas.matmul import calibration
from kernels_pallas.matmul import native_binding as matmul_native
from tests.support.calibrations import fresh_calibration, small_measure

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
NARROWER = calibration.NARROWER


def _times(triples: dict[int, tuple[float, float]]) -> dict[int, tuple[float, ...]]:
    """Times where the build's kernel takes `own` and the narrower one `narrow` of XLA's time."""
    return {rows: (own * 1e-3, 1e-3, narrow * 1e-3) for rows, (own, narrow) in triples.items()}


def test_the_narrower_build_takes_the_rows_it_wins_by_more_than_a_tie():
    times = {
        # Zen 4-like: AVX2 wins at 8 rows, ties at 1 and 4, loses from 16.
        "float32": _times({1: (0.9, 0.89), 4: (0.6, 0.59), 8: (1.1, 0.8), 16: (0.5, 0.7)}),
        "bfloat16": _times({1: (0.5, 0.6), 2: (0.5, 0.6)}),
    }
    assert calibration.choose_narrower(times) == {"float32": (8,), "bfloat16": ()}
    # The build's own kernel lost to XLA's dot at 8 rows, the narrower one won: 8 stays native.
    assert calibration.choose(times) == {"float32": range(1, 17), "bfloat16": range(1, 3)}
    alone = {"float32": {8: (1.1e-3, 1e-3)}}  # no narrower build timed: XLA's dot
    assert calibration.choose_narrower(alone) == {"float32": ()}
    assert calibration.choose(alone) == {"float32": range(0)}


@pytest.mark.parametrize(
    ("isa", "flags", "narrower"),
    [
        ("native", {"avx512f", "avx2", "fma", "bmi2", "f16c", "movbe"}, NARROWER),
        ("native", {"avx2", "fma", "bmi2", "f16c", "movbe"}, None),  # native is AVX2 already
        ("x86-64-v4", {"avx512f", "avx2", "fma", "bmi2", "f16c", "movbe"}, NARROWER),
        ("x86-64-v3", {"avx512f", "avx2", "fma", "bmi2", "f16c", "movbe"}, None),
        ("native", {"avx512f", "sse4_2"}, None),  # cannot run the narrower build's code
    ],
)
def test_only_an_avx512_build_has_a_narrower_one(monkeypatch, isa, flags, narrower):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(flags))
    assert calibration.narrower_build(isa) == narrower


@pytest.fixture()
def unpinned(tmp_path, monkeypatch):
    """No choice set by the variable, a fresh cache, and calibrations whose narrower build wins
    at 8 rows (and, for the lm head, at 2)."""

    def times() -> calibration.Times:
        both = {1: (1.0, 1.0), 2: (0.6, 0.6), 8: (0.7, 0.5), 16: (0.6, 0.8)}
        return {
            "float32": _times(both),
            "bfloat16": _times({1: (0.5, 0.6)}),
            "float32:wide": _times({1: (1.0, 1.0), 2: (0.8, 0.6), 8: (0.7, 0.7)}),
            "bfloat16:wide": _times({1: (1.5, 1.5)}),
            "int8": _times({1: (0.5, 0.6), 8: (0.5, 0.4)}),  # timed for the build only
        }

    yield from fresh_calibration(tmp_path, monkeypatch, times)


def test_the_choice_of_build_is_cached_and_read_back(unpinned):
    assert calibration.native_build(F32, 8, "native") == NARROWER
    assert calibration.native_build(F32, 12, "native") == NARROWER  # the candidate at or below
    assert calibration.native_build(F32, 16, "native") == "native"
    assert calibration.native_build(F32, 2, "native") == "native"
    assert calibration.native_build(F32, 2, "native", columns=32000) == NARROWER
    assert calibration.native_build(BF16, 8, "native") == "native"
    assert calibration.native_build(jnp.int8, 8, "native", columns=32000) == NARROWER
    assert calibration.native_build(jnp.int8, 1, "native") == "native"
    assert "int8" not in calibration.calibrated("native").rows  # rows follow x's dtype
    calibration._calibrated.cache_clear()  # a new process
    assert calibration.native_build(F32, 8, "native") == NARROWER
    assert unpinned == ["native"]  # read, not measured
    path = native.cached_beside("matmul", "native", calibration.CACHE_SUFFIX)
    cached = json.loads(path.read_text())
    assert cached["narrower"] == {
        "float32": [8],
        "bfloat16": [],
        "float32:wide": [2],
        "bfloat16:wide": [],
        "int8": [8],
    }
    assert calibration.describe(calibration.load(path).rows, cached["narrower"]) == (
        f"float32 rows 1-16 (8 by {NARROWER}), bfloat16 rows 1-1, "
        f"float32:wide rows 1-8 (2 by {NARROWER}), bfloat16:wide XLA"
    )
    # Programs traced under another choice of build are other programs.
    key = calibration.in_force("native")
    cached["narrower"]["float32"] = []
    path.write_text(json.dumps(cached))
    calibration._calibrated.cache_clear()
    assert calibration.native_build(F32, 8, "native") == "native"
    assert calibration.in_force("native") != key
    cached["narrower"]["float32"] = [8, 12]  # not a candidate a calibration times
    path.write_text(json.dumps(cached))
    calibration._calibrated.cache_clear()
    assert calibration.load(path) is None
    assert calibration.native_build(F32, 8, "native") == NARROWER  # measured again
    assert unpinned == ["native", "native"]


def test_a_step_dispatches_its_products_to_the_chosen_build(unpinned, monkeypatch):
    if not native.runs_here(NARROWER):
        pytest.skip(f"this CPU cannot run the {NARROWER} build")
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    isa = native.build_isa()
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(8, 2048, F32).args == (matmul_native.targets(NARROWER),)
        assert dispatch.matmul(16, 2048, F32).args == (matmul_native.targets(isa),)
        several = dispatch.matmuls(8, (1024, 1024), F32)
        assert several.args == (matmul_native.targets(NARROWER, matmul_native.SEVERAL),)
        assert dispatch.matmuls(2, (128, 128), F32).args[0] == matmul_native.targets(
            isa, matmul_native.SEVERAL
        )
        x, q = jnp.ones((8, 256), jnp.float32), jnp.ones((256, 512), jnp.int8)
        int8_program = jax.jit(dispatch.int8_matmul(8, F32)).lower(x, q).as_text()
        assert matmul_native.targets(NARROWER)[jnp.dtype(jnp.int8)] in int8_program
    monkeypatch.setenv(calibration.ROWS_ENV, "float32=1-64")
    with dispatch.kernels("native"), head_parallel.across(one):
        assert dispatch.matmul(8, 2048, F32).args == (matmul_native.targets(isa),)
        int8_program = jax.jit(dispatch.int8_matmul(8, F32)).lower(x, q).as_text()
        assert matmul_native.targets(isa)[jnp.dtype(jnp.int8)] in int8_program
        assert matmul_native.targets(NARROWER)[jnp.dtype(jnp.int8)] not in int8_program


@pytest.mark.parametrize("dtype", [F32, BF16, jnp.dtype(jnp.int8)])
def test_the_narrower_build_gives_the_same_bits(dtype):
    """What makes the choice free: each output sums over k in order, whatever the width."""
    builds = [isa for isa in ("native", NARROWER) if native.runs_here(isa)]
    r = np.random.default_rng(5)
    x = jnp.asarray(r.normal(size=(8, 300)), jnp.float32)
    ws = [jnp.asarray(r.normal(size=(300, n)) * 40, dtype) for n in (520, 37)]
    if dtype == jnp.int8:  # one weight a call: `matmuls` takes fp32 and bf16
        single = [matmul_native.matmul(matmul_native.targets(b), x, ws[0]) for b in builds]
        for b, out in zip(builds[1:], single[1:], strict=True):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(single[0]), err_msg=b)
        return
    outs = [
        matmul_native.matmuls(matmul_native.targets(b, matmul_native.SEVERAL), x, ws)
        for b in builds
    ]
    for b, out in zip(builds[1:], outs[1:], strict=True):
        for got, want in zip(out, outs[0], strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=b)


def test_a_narrower_build_whose_bits_differ_is_left_out(unpinned, monkeypatch, caplog):
    """Checked in code, not assumed: a narrower kernel that rounds differently would change
    tokens with the batch size, so the calibration drops it and the build's own runs."""
    monkeypatch.setattr(calibration, "narrower_build", lambda isa: NARROWER)
    real_kernel = calibration._kernel

    def kernel(isa: str, pair: bool = False):
        own = real_kernel(native.build_isa(), pair)
        if isa != NARROWER:
            return own
        # The same bits at 2 rows, others at 8: the times taken at 2 rows are dropped too.
        return jax.jit(lambda x, w: own(x, w) * (1 + 2**-20 * (x.shape[0] == 8)))

    monkeypatch.setattr(calibration, "_kernel", kernel)
    with caplog.at_level(logging.WARNING, logger=calibration.__name__):
        times = small_measure(native.build_isa())
    assert f"the {NARROWER} build's matmul differs" in caplog.text
    assert all(len(t) == 2 for by_rows in times.values() for t in by_rows.values())
    assert calibration.choose_narrower(times) == {
        n: () for n in (*calibration.KEYS, calibration.INT8)
    }
