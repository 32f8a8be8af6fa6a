"""`bench matmul --strides` sets each weight beside a peer whose rows are a cache line further
apart, and times the two in turns whose order alternates, so that a slow spell slows both."""

from __future__ import annotations

import pytest

from flipjax.benchmarks.matmul_strides import line_wider, paired_seconds


@pytest.mark.parametrize("n, itemsize", [(2048, 4), (2048, 2), (768, 4), (32000, 4), (256, 1)])
def test_the_peer_is_a_line_wider_and_its_rows_leave_the_1k_grid(n, itemsize):
    wide = line_wider(n, itemsize)
    assert (wide - n) * itemsize == 64
    assert (wide * itemsize) % 1024 != 0


def test_a_width_the_peer_cannot_have_is_refused_by_name():
    with pytest.raises(ValueError, match="line_wider"):
        line_wider(0, 4)
    with pytest.raises(ValueError, match="itemsize dividing 64"):
        line_wider(2048, 3)


def test_the_two_run_in_turns_whose_order_alternates():
    calls: list[str] = []
    now = [0.0]

    def run(name: str, seconds: float):
        def call() -> None:
            calls.append(name)
            now[0] += seconds

        return call

    # A spell that slows whichever runs first in a round would bias an unalternated pair.
    first_s, second_s = paired_seconds(run("w", 2.0), run("peer", 1.0), 4, lambda: now[0])
    assert calls == ["w", "peer", "peer", "w", "w", "peer", "peer", "w"]
    assert (first_s, second_s) == (2.0, 1.0)


def test_the_medians_are_each_products_own():
    times = iter([5.0, 1.0, 1.0, 12.0, 7.0, 1.0])  # round by round: w, peer / peer, w / w, peer
    elapsed: list[float] = []

    def clock() -> float:
        # Two reads a call: start at 0, end at the call's time.
        if len(elapsed) % 2 == 0:
            elapsed.append(0.0)
            return 0.0
        elapsed.append(next(times))
        return elapsed[-1]

    first_s, second_s = paired_seconds(lambda: None, lambda: None, 3, clock)
    # w ran 5, 12, 7 (median 7, mean 8); the peer 1, 1, 1.
    assert (first_s, second_s) == (7.0, 1.0)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        paired_seconds(lambda: None, lambda: None, 0, clock)
