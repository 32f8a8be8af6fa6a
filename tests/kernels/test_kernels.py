"""Pallas kernels (interpret mode) against their pure-JAX references, and the dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas import dispatch
from kernels_pallas.gdn import reference as gdn
from kernels_pallas.gdn.pallas_kernel import delta_rule_kernel
from kernels_pallas.paged_attention.pallas_kernel import ragged_paged_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference
from tests.support.kernel_cases import paged_case

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def assert_attention_matches(case: tuple[jax.Array, ...], dtype: jnp.dtype, **options) -> None:
    q, k, v, table, positions = case
    want = paged_attention_reference(q, k, v, table, positions)
    got = ragged_paged_attention(q, k, v, table, positions, interpret=True, **options)
    valid = np.asarray(positions >= 0)
    want, got = (np.asarray(a.astype(jnp.float32)) for a in (want, got))
    np.testing.assert_allclose(got[valid], want[valid], atol=TOLERANCE[dtype], rtol=0)
    assert np.all(got[~valid] == 0), "padding rows must come out as zeros"


@pytest.mark.parametrize(
    ("rows", "kv_heads", "group", "page_size", "options"),
    [
        # decode rows at length 1, page boundaries, and an empty slot
        ([(1, 1), (4, 1), (5, 1), (8, 1), (0, 0), (13, 1)], 2, 2, 4, {}),
        # a prefill chunk continuing earlier pages beside decode rows and padding
        ([(37, 11), (9, 1), (16, 16), (0, 0)], 2, 4, 8, dict(pages_per_block=2)),
        # no grouping (MHA), many pages, split across programs
        ([(70, 1), (3, 3), (64, 1)], 4, 1, 4, dict(kv_splits=3, pages_per_block=4)),
        # GQA 8, query tiles smaller than one token's group
        ([(20, 2), (1, 1)], 1, 8, 16, dict(block_rows=4)),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_paged_attention_matches_reference(rows, kv_heads, group, page_size, options, dtype):
    case = paged_case(0, rows, kv_heads, group, page_size, dtype)
    assert_attention_matches(case, dtype, **options)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    contexts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), min_size=1, max_size=4),
    group=st.sampled_from([1, 2, 4]),
    page_size=st.sampled_from([4, 8, 16]),
    kv_splits=st.sampled_from([1, 2]),
)
def test_ragged_paged_attention_property(seed, contexts, group, page_size, kv_splits):
    rows = [(cached + new, new) for cached, new in contexts]
    case = paged_case(seed, rows, 2, group, page_size, jnp.float32)
    assert_attention_matches(case, jnp.float32, kv_splits=kv_splits, pages_per_block=2)


def test_ragged_paged_attention_refuses_mismatched_shapes():
    q, k, v, table, positions = paged_case(0, [(3, 1)], 2, 2, 4, jnp.float32)
    with pytest.raises(ValueError, match="positions"):
        ragged_paged_attention(q, k, v, table, positions[:, :0], interpret=True)
    with pytest.raises(ValueError, match="query heads"):
        ragged_paged_attention(q[:, :, :3], k, v, table, positions, interpret=True)


def gdn_inputs(seed: int, t: int, lengths: list[int]) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    b, hk, hv, dk, dv = len(lengths), 2, 4, 32, 16
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    g = -jnp.asarray(rng.uniform(0.0, 1.0, (b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, hv)), jnp.float32)
    valid = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]
    return f(b, t, hk, dk), f(b, t, hk, dk), f(b, t, hv, dv), g, beta, f(b, hv, dk, dv), valid


@pytest.mark.parametrize(
    ("t", "lengths"),
    [(1, [1, 0, 1]), (64, [64, 5]), (150, [150, 100, 1]), (7, [7])],
)
def test_gdn_kernels_match_reference(t, lengths):
    """Outputs and the returned final state, with a non-zero starting state and padding."""
    args = gdn_inputs(t, t, lengths)
    valid = np.asarray(args[-1])
    got_o, got_s = delta_rule_kernel(*args, interpret=True)
    for reference in (gdn.delta_rule_recurrent, gdn.delta_rule_chunked):
        want_o, want_s = reference(*args)
        np.testing.assert_allclose(np.asarray(got_o)[valid], np.asarray(want_o)[valid], atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_s), np.asarray(want_s), atol=1e-5)


def test_dispatch_modes(monkeypatch):
    monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
    assert dispatch.default_mode() == "native"  # the CPU default where the native kernels build
    monkeypatch.setenv(dispatch.KERNELS_ENV, "interpret")
    assert dispatch.current_mode() == "interpret"
    with dispatch.kernels("reference"):
        assert dispatch.current_mode() == "reference"
        assert dispatch.delta_rule(1) is gdn.delta_rule_recurrent
    assert dispatch.delta_rule(1).func is delta_rule_kernel
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    with pytest.raises(ValueError, match="FLIPJAX_KERNELS"):
        dispatch.current_mode()


def test_check_script_runs_every_kernel(capsys):
    """`python -m kernels_pallas.check` on small shapes: one line per kernel, errors small."""
    from kernels_pallas import check

    check.main(["--shapes", "small", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device ")
    kernels = lines[1:]
    assert [line.split()[0] for line in kernels] == [
        "paged_attention",
        "paged_attention",
        "gdn",
        "gdn",
    ]
    for line in kernels:
        err = float(line.split("max_err")[1].split()[0])
        assert err < 2e-2, line
