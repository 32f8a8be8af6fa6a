"""The MTP head's drafts stay on the device from the verify step that made them to the next one:
made there from the sampled tokens as the host would make them, and fed to the next step
without a trip to the host while the batch stays the same."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flipjax import Engine, SamplingParams
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned
from tests.support.speculation import PROMPTS, speculative


@pytest.fixture(scope="module")
def spec() -> Engine:
    return speculative(3)


def test_a_steady_batch_s_verify_steps_take_the_drafts_on_the_device(spec):
    """Only the first verify step (its drafts came from the prompt's prefill, on the host) and
    the one after the batch shrinks to another bucket take drafts from the host."""
    speculation = parts(spec).stepper.speculation
    for lengths in ([40], [40, 12]):
        fed, steps = speculation.counters["fed"], speculation.policy.counters["speculated"]
        sampling = [SamplingParams.greedy().replace(max_tokens=n) for n in lengths]
        out = spec.generate(PROMPTS[: len(lengths)], sampling=sampling)
        assert [len(o.token_ids) for o in out] == lengths
        steps = speculation.policy.counters["speculated"] - steps
        assert speculation.counters["fed"] - fed == steps - len(lengths)


def test_requests_retracted_while_their_drafts_are_on_the_device_lose_no_token(spec):
    """A pool too small for the batch retracts requests between verify steps; they resume
    (recomputed, drafting again from their prompt) with the tokens of the roomy run."""
    sampling = SamplingParams.greedy().replace(max_tokens=40)
    roomy = [o.token_ids for o in spec.generate(PROMPTS, sampling=sampling)]
    tight = speculative(3, num_pages=14, prefix_cache=False)
    assert [o.token_ids for o in tight.generate(PROMPTS, sampling=sampling)] == roomy
    assert tight.stats().scheduling.get("retracted", 0) > 0
    assert parts(tight).stepper.speculation.counters["fed"] > 0
    assert_pools_returned(tight)


def test_drafts_made_after_a_verify_step_on_the_device_are_the_host_path_s(spec):
    """`Drafter.draft_verified` finds each row's accepted positions from the sampled tokens on
    the device; its drafts, the tokens it counts and the head's K/V it writes are those of
    `Drafter.draft` given the positions the host's commit would find."""
    drafter = parts(spec).stepper.speculation.drafter
    runner = parts(spec).runner
    rng = np.random.default_rng(0)
    hidden = jax.device_put(rng.standard_normal((2, 4, 256)).astype(np.float32), drafter.device)
    sampled = np.array([[7, 8, 9, 10], [11, 12, 13, 14]], np.int32)
    # The step's pending tokens, then its drafts: row 0's agree twice; row 1's, three times.
    tokens = np.array([[1, 7, 8, 5], [2, 11, 12, 13]], np.int32)
    allowed = np.array([3, 1], np.int32)  # of which row 1 may check only its first
    starts = np.array([10, 20], np.int32)
    table = np.zeros((2, runner.table_width), np.int32)
    table[0, :2], table[1, :2] = [3, 4], [5, 6]
    before = jax.device_get(drafter.kv)
    new, taken = drafter.draft_verified(
        hidden, jax.device_put(sampled.reshape(-1), drafter.device), tokens, starts, allowed, table
    )
    new, taken, after = jax.device_get((new, taken, drafter.kv))
    assert taken.tolist() == [3, 2]
    drafter.kv = jax.device_put(before, drafter.device)
    positions = np.array([[10, 11, 12, -1], [20, 21, -1, -1]], np.int32)
    want = drafter.draft(hidden, sampled, positions, table)
    np.testing.assert_array_equal(new, want)
    for got, expected in zip(jax.tree.leaves(after), jax.tree.leaves(drafter.kv), strict=True):
        np.testing.assert_array_equal(got, np.asarray(expected))
