"""A row count whose verdict both its neighbours contradict is timed again before it decides:
a spell of a shared machine at one row count must not hand the rows around it to the slower
path. The verdicts come from `calibration_choice.disputed`; `measure` runs the disputed row
counts AGAIN times as many rounds more and pools their ratios with the first ones."""

from __future__ import annotations

import jax
import pytest

from kernels_pallas import native
from kernels_pallas.matmul import calibration
from kernels_pallas.matmul.calibration_choice import TIE, disputed


def test_a_lone_verdict_between_two_that_agree_is_disputed():
    # The lm head of one AVX2 calibration: the kernel lost at 1, won at 2, lost at 4 ...
    lm_head = {1: 1.04, 2: 0.64, 4: 1.12, 8: 0.88, 16: 1.14, 24: 1.04, 32: 1.09}
    assert disputed(lm_head) == [2, 4, 8]
    steady = {1: 0.9, 2: 0.6, 4: 0.7, 8: 0.8, 16: 1.1, 32: 1.3}  # won, then lost: no dispute
    assert disputed(steady) == []
    # A tie decides nothing, and is no neighbour to dispute against; the ends have one.
    ties = {1: 1.0 + TIE / 2, 2: 0.5, 4: 1.0, 8: 1.2, 16: 0.7}
    assert disputed(ties) == []
    assert disputed({1: 2.0, 2: 0.5}) == [] and disputed({}) == []


@pytest.fixture()
def scripted_passes(monkeypatch):
    """`measure` with timed passes that report scripted seconds: the kernel's pass at 4 rows
    reads slow for the first pass's rounds only (a spell), every other kernel pass wins by half;
    XLA's always takes 1 ms. Yields the number of rounds each row count's kernel pass ran."""
    monkeypatch.setattr(calibration, "narrower_build", lambda isa: None)
    calls: dict[tuple, int] = {}  # kernel passes run, by (weight shape, dtype, weights, rows)
    created: list[tuple] = []

    def scripted(product, weights):
        w = jax.tree.leaves(weights[0])  # a pair of projections, or one weight
        key = (w[0].shape, w[0].dtype, len(w), product(weights[0]).shape[0])
        kernel = created.count(key) % 2 == 0  # each row count's passes: the kernel's, XLA's
        created.append(key)

        def timed() -> float:
            if not kernel:
                return 1e-3
            calls[key] = calls.get(key, 0) + 1
            spell = key[-1] == 4 and calls[key] <= ROUNDS
            return 2e-3 if spell else 0.5e-3

        return timed

    monkeypatch.setattr(calibration, "_timed_pass", scripted)
    yield calls


ROUNDS = 3


def test_a_disputed_row_count_is_timed_again_and_decided_by_all_its_rounds(scripted_passes):
    times = calibration.measure(
        native.build_isa(),
        rows=(2, 4, 8),
        shape=(64, 128),
        sweep_bytes=1 << 16,
        rounds=ROUNDS,
        wide_shape=(64, 256),
    )
    # Every weight's 4 rows were disputed (lost between two wins) and ran AGAIN x more
    # rounds; pooled, the spell's rounds are the minority and the kernel takes 2-8 rows.
    assert len(scripted_passes) == 3 * len(calibration.KEYS)
    for key, rounds in scripted_passes.items():
        rows = key[-1]
        assert rounds == ROUNDS * (1 + calibration.AGAIN if rows == 4 else 1), rows
    assert calibration.choose(times) == {name: range(2, 9) for name in calibration.KEYS}
