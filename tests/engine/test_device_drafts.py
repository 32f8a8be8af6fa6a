"""The drafts a verify step leaves on the device reach their requests on the host only when
fetched, each after the count of tokens the host committed for it, and are refused, naming
the request, when the device drafted after another count."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flipjax import SamplingParams
from flipjax.engine.device_drafts import DeviceDrafts
from flipjax.engine.sequence import Sequence


def _seq(name: str) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams.greedy(), max_tokens=8, seed=0)


def test_held_drafts_are_counted_then_given_to_their_requests_when_fetched():
    a, b, other = _seq("a"), _seq("b"), _seq("other")
    held = DeviceDrafts()
    drafts = jnp.array([[5, 6, 7], [0, 0, 0], [8, 9, 10]], jnp.int32)
    held.hold(drafts, jnp.array([2, 0, 1], jnp.int32), [(a, 0, 2), (b, 2, 1)])
    assert (held.row(a), held.row(b), held.row(other)) == (0, 2, -1)
    assert (held.count(a), held.count(other)) == (3, 0)
    assert a.drafts == [] and b.drafts == []  # not on the host yet
    held.fetch()
    assert (a.drafts, b.drafts, other.drafts) == ([5, 6, 7], [8, 9, 10], [])
    assert held.drafts is None and held.row(a) == -1


def test_drafts_made_after_another_count_than_the_host_committed_are_refused():
    a = _seq("req-7")
    held = DeviceDrafts()
    held.hold(jnp.zeros((1, 3), jnp.int32), jnp.array([3], jnp.int32), [(a, 0, 2)])
    with pytest.raises(RuntimeError, match="request req-7 took 2 tokens, its drafts were made"):
        held.fetch()
    assert a.drafts == []
