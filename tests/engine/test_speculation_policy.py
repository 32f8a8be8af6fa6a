"""The speculation policy takes, per batch size, the way this machine measures faster, and
measures the other again now and then; without `adaptive` it always speculates."""

from __future__ import annotations

from collections import Counter

from flipjax.engine.speculation_policy import (
    FIRST_MEASURE,
    MAX_REPROBE_EVERY,
    PROBE_STEPS,
    REPROBE_EVERY,
    TAIL_MARGIN,
    SpeculationPolicy,
)

# The first measure: each way in turns of PROBE_STEPS, the first step of each turn uncounted.
TURNS = FIRST_MEASURE // PROBE_STEPS
FIRST = 2 * TURNS * (PROBE_STEPS + 1)


def _drive(policy: SpeculationPolicy, rates: dict[int, dict[bool, float]], steps: int) -> list:
    """Run `steps` decode steps per batch size, each way taking tokens at its rate (tokens a
    second); returns the ways taken, per step, as (rows, speculated)."""
    taken = []
    for _ in range(steps):
        for rows, rate in rates.items():
            way = policy.speculate(rows)
            policy.record(rows, way, int(rate[way] * 10), 10.0)
            taken.append((rows, way))
    return taken


def test_each_batch_size_settles_on_its_faster_way_and_measures_the_other_again():
    policy = SpeculationPolicy()
    rates = {1: {True: 300.0, False: 100.0}, 8: {True: 500.0, False: 900.0}}
    taken = _drive(policy, rates, FIRST + REPROBE_EVERY + 3 * PROBE_STEPS)
    for rows, faster in ((1, True), (8, False)):
        ways = [way for r, way in taken if r == rows]
        probe = FIRST
        turns = [True] * (PROBE_STEPS + 1) + [False] * (PROBE_STEPS + 1)
        assert ways[:probe] == turns * TURNS
        settled = ways[probe : probe + REPROBE_EVERY]
        assert settled == [faster] * REPROBE_EVERY
        again = ways[probe + REPROBE_EVERY : probe + REPROBE_EVERY + PROBE_STEPS + 1]
        assert again == [not faster] * (PROBE_STEPS + 1)
        assert ways[probe + REPROBE_EVERY + PROBE_STEPS + 1] is faster
    # Each turn of the first measure; then batch 1 back to speculating, to plain to measure
    # it and back; batch 8 stays on plain, measures speculation and comes back.
    first = 2 * TURNS - 1
    assert policy.counters["switches"] == (first + 3) + (first + 2)


def test_a_change_in_load_is_followed_at_the_next_measurement():
    policy = SpeculationPolicy()
    _drive(policy, {1: {True: 300.0, False: 100.0}}, FIRST + 5)
    assert policy.speculate(1) is True
    taken = _drive(policy, {1: {True: 50.0, False: 100.0}}, REPROBE_EVERY + 2 * PROBE_STEPS + 4)
    assert taken[-1] == (1, False)


def test_without_adaptive_every_step_speculates():
    policy = SpeculationPolicy(adaptive=False)
    taken = _drive(policy, {4: {True: 1.0, False: 1000.0}}, 100)
    assert all(way for _, way in taken)
    assert policy.counters["plain"] == 0


def test_a_way_is_judged_by_its_tokens_per_step_over_its_usual_step_time():
    """Verify steps take about the same time however many drafts they keep, so speculation's
    rate is its mean tokens per step over its median step time; a median of per-step rates
    would take the steps that kept few drafts for the typical one. A rare stall (here a plain
    step of 40 ms) moves neither way's measure."""
    policy = SpeculationPolicy()
    kept = iter([1, 1, 1, 1, 4, 4] * 4)  # 2 tokens a verify step, each 10 ms: 200 a second
    stalls = iter([6e-3] * 5 + [40e-3] + [6e-3] * 20)  # 1 token a plain step: 167 a second
    for _ in range(FIRST + 1):
        if policy.speculate(1):
            policy.record(1, True, next(kept), 10e-3)
        else:
            policy.record(1, False, 1, next(stalls))
    assert policy.speculate(1) is True


def _chosen_runs(ways: list[bool], chosen: bool) -> list[int]:
    """The lengths of the runs of `chosen` between measures of the other way."""
    runs, n = [], 0
    for way in ways:
        if way == chosen:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_a_measure_that_confirms_the_choice_doubles_the_wait_before_the_next():
    """Measuring the slower way costs its slower steps: while the load stays, the waits grow
    192, 384, 768, then stay at eight times; a change of choice (here as the chosen way's own
    steps slow down) sets them back."""
    policy = SpeculationPolicy()
    steady = {1: {True: 300.0, False: 100.0}}
    ways = [way for _, way in _drive(policy, steady, FIRST + 5000)]
    waits = _chosen_runs(ways[FIRST:], True)
    assert MAX_REPROBE_EVERY == 8 * REPROBE_EVERY
    assert waits[:5] == [REPROBE_EVERY * f for f in (1, 2, 4, 8, 8)]
    turned = {1: {True: 50.0, False: 100.0}}
    ways = [way for _, way in _drive(policy, turned, 2 * MAX_REPROBE_EVERY)]
    assert _chosen_runs(ways, False)[:3] == [REPROBE_EVERY * f for f in (1, 2, 4)]


def test_one_lucky_measure_of_the_slower_way_does_not_turn_the_choice():
    """Speculation twice as fast: a measure in which plain steps ran 2.5 times their usual
    speed (a quiet spell on a busy machine) is judged with the plain steps measured before it,
    and speculation stays chosen."""
    policy = SpeculationPolicy()
    usual = {1: {True: 200.0, False: 100.0}}
    _drive(policy, usual, FIRST + 20)
    lucky = {1: {True: 200.0, False: 250.0}}
    taken = _drive(policy, lucky, REPROBE_EVERY + PROBE_STEPS + 4)
    assert [way for _, way in taken[-3:]] == [True] * 3
    assert Counter(way for _, way in taken)[False] == PROBE_STEPS + 1


def test_over_more_than_one_row_speculation_must_win_by_the_tail_margin():
    """The rows of a batch that speculates end apart, and a batch that is not refilled pays for
    its ragged end, which no step's measure shows: a step a tenth faster is not enough at 8
    rows, while at 1 row (no rows to end apart) it is, and so is a margin's worth at 8."""
    slightly = {True: 110.0, False: 100.0}
    clearly = {True: 100.0 * (1 + TAIL_MARGIN) + 10.0, False: 100.0}
    for rows, rates, speculates in ((8, slightly, False), (1, slightly, True), (8, clearly, True)):
        policy = SpeculationPolicy()
        taken = _drive(policy, {rows: rates}, FIRST + 50)
        assert [way for _, way in taken[FIRST:]] == [speculates] * 50, (rows, rates)
