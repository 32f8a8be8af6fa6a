"""A fresh native-matmul calibration for a test: no choice pinned by the variable, a cache of
the test's own, and `measure` replaced by times the test gives, each call of it counted."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest

from kernels_pallas import native
from kernels_pallas.matmul import calibration


def fresh_calibration(
    tmp_path, monkeypatch: pytest.MonkeyPatch, times: Callable[[], calibration.Times]
) -> Iterator[list[str]]:
    """Yields the builds measured, in order, while the test runs."""
    monkeypatch.delenv(calibration.ROWS_ENV, raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "native"))
    calibration._calibrated.cache_clear()
    measured: list[str] = []

    def fake_measure(isa: str) -> calibration.Times:
        measured.append(isa)
        return times()

    monkeypatch.setattr(calibration, "measure", fake_measure)
    yield measured
    calibration._calibrated.cache_clear()


# The real calibration over small weights, two row counts and one round: seconds, not a minute.
small_measure = functools.partial(
    calibration.measure,
    rows=(2, 8),
    shape=(256, 512),
    sweep_bytes=1 << 20,
    rounds=1,
    wide_shape=(256, 1024),
)
