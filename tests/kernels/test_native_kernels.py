"""The native CPU kernels: built here, equal to the pure-JAX step they replace, and used by
the engine's decode steps on every layout without gathering a sharded pool (the GDN update on
every layout, the experts' grouped matmul on every layout and at every size, the matmul where a
stage has one device; their own checks are in `test_native_matmul.py` and
`test_native_ragged_matmul.py`).

The oracle is `gdn.reference`'s recurrence over rows gathered from the pool (the form the
engine ran before the kernel) and, end to end, the engine's tokens with the kernel switched off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax import Engine
from kernels_pallas import dispatch, native
from kernels_pallas.gdn import native_binding as gdn_native
from kernels_pallas.gdn import reference as gdn_reference
from tests.support.internals import parts
from tests.support.pool_gathers import gathers_of_pools

OPTIONS = dict(num_pages=64, max_running_requests=3, max_prefill_tokens=32)
PROMPTS = [[(i * 7 + 3) % 256 for i in range(n)] for n in (5, 23, 40)]


def test_the_gdn_decode_kernel_builds_on_this_machine():
    # A build failure falls back to the references with a warning; here it fails loudly.
    assert native.build("gdn_decode").exists()
    assert native.target("gdn_decode") == "flipjax_gdn_decode"
    assert native.available()


def _case(rows: int, slots: int, hk: int, hv: int, d: int, seed: int = 0):
    r = np.random.default_rng(seed)
    pool = r.normal(0, 0.3, (slots, hv, d, d)).astype(np.float32)
    q, k = (r.normal(size=(rows, 1, hk, d)).astype(np.float32) for _ in range(2))
    v = r.normal(size=(rows, 1, hv, d)).astype(np.float32)
    g = -np.abs(r.normal(size=(rows, 1, hv))).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.normal(size=(rows, 1, hv))))).astype(np.float32)
    return pool, q, k, v, g, beta


# Head widths: one the kernel sums through a scratch (16), and the two compiled in (64, 128).
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 6)])  # value heads sharing key heads
def test_pooled_decode_is_the_reference_step_in_each_rows_slot(hk, hv, d):
    pool, q, k, v, g, beta = _case(rows=5, slots=7, hk=hk, hv=hv, d=d)
    # Rows read out of order; row 2 starts fresh (reads one past the pool) into slot 3; row 4
    # is padding (reads and writes far beyond).
    reads = np.array([4, 0, 7, 6, 99], np.int32)
    writes = np.array([4, 0, 3, 6, 99], np.int32)
    valid = np.array([[True], [True], [True], [True], [False]])
    target = native.target("gdn_decode")
    out, new_pool = jax.jit(gdn_native.pooled_decode, static_argnums=0)(
        target, pool, reads, writes, q, k, v, g, beta, valid
    )
    gathered = jnp.take(pool, reads, axis=0, mode="fill", fill_value=0)
    want_out, want_rows = gdn_reference.delta_rule_recurrent(q, k, v, g, beta, gathered, valid)
    want_pool = pool.copy()
    want_pool[writes[:4]] = np.asarray(want_rows)[:4]
    out, new_pool = np.asarray(out), np.asarray(new_pool)
    np.testing.assert_allclose(out[:4], np.asarray(want_out)[:4], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[4], 0)  # padding: no state, a zero output
    np.testing.assert_allclose(new_pool, want_pool, rtol=1e-6, atol=1e-6)
    for untouched in (1, 2, 5):  # slots no row writes keep their states bit for bit
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("d", [16, 64])
def test_a_chain_of_tokens_leaves_each_state_of_a_decode_step_per_token_bit_for_bit(d):
    """A speculative verify step gives the kernel several tokens per row and a slot for the state
    after each: every state and output is the one the one-token step reaches, token by token."""
    pool, *_ = _case(rows=3, slots=9, hk=2, hv=4, d=d)
    tokens = [_case(rows=3, slots=1, hk=2, hv=4, d=d, seed=s)[1:] for s in (1, 2, 3)]
    q, k, v, g, beta = (np.concatenate(parts, axis=1) for parts in zip(*tokens, strict=True))
    reads = np.array([4, 8, 9], np.int32)  # row 2 starts fresh (one past the pool)
    chain = np.array([[1, 2, 4], [5, 6, 99], [0, 99, 99]], np.int32)  # 99: padding from there
    valid = chain < 9
    target = native.target("gdn_decode")
    step = jax.jit(gdn_native.pooled_decode, static_argnums=0)
    out, chained = step(target, pool, reads, chain, q, k, v, g, beta, valid)
    want, at = np.asarray(pool), reads
    for t in range(3):
        one = (a[:, t : t + 1] for a in (q, k, v, g, beta, valid))
        o, want = step(target, want, at, chain[:, t], *one)
        np.testing.assert_array_equal(np.asarray(out)[:, t], np.asarray(o)[:, 0])
        at = chain[:, t]
    np.testing.assert_array_equal(np.asarray(chained), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(out)[1, 2], 0)  # padding: a zero output
    np.testing.assert_array_equal(np.asarray(chained)[[3, 7]], pool[[3, 7]])  # untouched


def test_pooled_decode_refuses_a_pool_that_is_not_float32():
    pool, q, k, v, g, beta = _case(rows=1, slots=2, hk=1, hv=1, d=8)
    slots, valid = np.zeros(1, np.int32), np.ones((1, 1), bool)
    with pytest.raises(ValueError, match="must be float32, got bfloat16"):
        gdn_native.pooled_decode(
            "flipjax_gdn_decode", pool.astype(jnp.bfloat16), slots, slots, q, k, v, g, beta, valid
        )


def test_a_failed_build_names_the_compiler_error_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="false .* failed"):
        native.build("gdn_decode")
    assert list(tmp_path.iterdir()) == []


def test_the_native_kernel_runs_in_native_mode_only():
    assert dispatch.default_mode() == "native"  # the CPU default where the kernels build
    for mode in ("reference", "interpret"):
        with dispatch.kernels(mode):
            assert dispatch.pooled_delta_rule(2, 4) is None
    with dispatch.kernels("native"):
        assert dispatch.pooled_delta_rule(2, 4).func is gdn_native.pooled_decode


def test_a_prefill_chunk_in_the_rows_own_slot_is_the_reference_recurrence():
    """A prefill row writes the state after every real token to its own slot, so the state
    carries through the chunk in place: the chunk's outputs and final state are XLA's scan
    over the gathered rows (the form prefill ran before), to rounding."""
    t = 37
    pool, *_ = _case(rows=4, slots=6, hk=2, hv=4, d=16)
    tokens = [_case(rows=4, slots=1, hk=2, hv=4, d=16, seed=s)[1:] for s in range(1, t + 1)]
    q, k, v, g, beta = (np.concatenate(parts, axis=1) for parts in zip(*tokens, strict=True))
    # Row 0 continues slot 2; row 1 starts fresh into slot 5; row 2, 20 real tokens, continues
    # slot 0; row 3 is padding.
    reads = np.array([2, 6, 0, 99], np.int32)
    slots = np.array([2, 5, 0, 99], np.int32)
    valid = np.arange(t)[None, :] < np.array([t, t, 20, 0])[:, None]
    chain = np.where(valid, slots[:, None], 6).astype(np.int32)
    target = native.target("gdn_decode")
    out, new_pool = jax.jit(gdn_native.pooled_decode, static_argnums=0)(
        target, pool, reads, chain, q, k, v, g, beta, valid
    )
    gathered = jnp.take(pool, reads, axis=0, mode="fill", fill_value=0)
    want_out, want_rows = gdn_reference.delta_rule_recurrent(q, k, v, g, beta, gathered, valid)
    out, new_pool, want_out = np.asarray(out), np.asarray(new_pool), np.asarray(want_out)
    np.testing.assert_allclose(out[valid], want_out[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[~valid], 0)  # padding: a zero output
    for row in range(3):
        np.testing.assert_allclose(new_pool[slots[row]], want_rows[row], rtol=1e-5, atol=1e-5)
    for untouched in (1, 3, 4):
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.fixture(scope="module")
def xla_tokens() -> list[list[int]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dispatch.KERNELS_ENV, "reference")
        engine = Engine.from_pretrained("tiny", **OPTIONS)
        assert "flipjax_gdn_decode" not in _decode_program(engine)
        assert "flipjax_paged_decode" not in _decode_program(engine)
        assert "flipjax_ragged_matmul" not in _decode_program(engine)
        assert "flipjax_conv_pool" not in _decode_program(engine)
        assert "flipjax_gated_norm" not in _decode_program(engine)
        assert "flipjax_silu_mul" not in _decode_program(engine)
        assert "flipjax_sigmoid_mul" not in _decode_program(engine)
        return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=6)]


def _count_decode_writes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The shapes of the decode steps whose write program runs, until `monkeypatch` undoes."""
    binding, calls = parts(engine).runner.binding, []
    programs = binding._stage_programs

    def counted(stage, shape, *args, **kwargs):
        step, write, in_place = programs(stage, shape, *args, **kwargs)

        def write_counted(*operands):
            if shape[1] == 1:
                calls.append(shape)
            return write(*operands)

        return step, write_counted, in_place

    monkeypatch.setattr(binding, "_stage_programs", counted)
    return calls


def _decode_program(engine: Engine, rows: int = 4) -> str:
    step, _ = parts(engine).runner.binding.programs(0, (rows, 1))
    return step.as_text()


@pytest.mark.parametrize("layout", ["single", "tp:2", "pp:4,4@2,2"])
def test_every_layout_decodes_with_the_kernel_to_the_xla_tokens(xla_tokens, layout, monkeypatch):
    engine = Engine.from_pretrained("tiny", layout=layout, **OPTIONS)
    assert parts(engine).runner.kernels == "native"
    decode_writes = _count_decode_writes(engine, monkeypatch)
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=6)] == xla_tokens
    monkeypatch.undo()
    # A decode step that updated every GDN state in its slot leaves no write program to run.
    assert (decode_writes == []) == (layout == "single")
    assert "flipjax_gdn_decode" in _decode_program(engine)
    assert "flipjax_paged_decode" in _decode_program(engine)  # per device over its heads
    assert "flipjax_gated_norm" in _decode_program(engine)  # so too the GDN output norm
    # The experts' grouped matmul on every layout (per device over a TP mesh), at every size.
    assert "flipjax_ragged_matmul" in _decode_program(engine)
    # The matmul kernel only where a stage has one device: the partitioner cannot split it.
    assert ("flipjax_matmul" in _decode_program(engine)) == (layout == "single")
    # So too the conv in the conv pools' slots, which then leaves the write program nothing.
    assert ("flipjax_conv_pool" in _decode_program(engine)) == (layout == "single")
    for gate in ("flipjax_silu_mul", "flipjax_sigmoid_mul"):  # the MLP's and attention's gates
        assert (gate in _decode_program(engine)) == (layout == "single")
    if layout == "single":
        write = parts(engine).runner.binding.programs(0, (4, 1))[1].as_text()
        assert "flipjax_write_rows" not in write and "scatter" not in write
        # The conv reads q, k and v in the projection's rows: no copy concatenates them.
        conv_dim = engine.info.model.conv_dim
        assert f"f32[4,1,{conv_dim}]{{2,1,0}} concatenate" not in _decode_program(engine)
    if layout == "single":
        # Projections of one input share a call, so no narrow one is left to XLA's dot (a GDN
        # layer's in_proj_ba, the router and the shared expert's gate).
        assert "flipjax_matmuls" in _decode_program(engine)
        assert " dot(" not in _decode_program(engine)
        assert "flipjax_matmul" not in _decode_program(engine, rows=1)  # XLA's matvec
        prefill, _ = parts(engine).runner.binding.programs(0, (1, 64))  # 64 rows: XLA's GEMM
        assert "flipjax_matmul" not in prefill.as_text()
        assert "flipjax_paged_decode" not in prefill.as_text()
        assert "flipjax_ragged_matmul" in prefill.as_text()
    for shape in ((4, 1), (1, 64)):  # decode and prefill update the GDN pools themselves
        step, _, in_place = parts(engine).runner.binding._stage_programs(0, shape)
        assert in_place
        assert "flipjax_gdn_decode" in step.as_text()
    if layout == "tp:2":
        assert gathers_of_pools(engine, (4, 1)) == []
        # The gated norm per device over its half of the heads, not on gathered operands.
        cfg = engine.info.model
        half = f"f32[4,1,{cfg.linear_num_value_heads // 2},{cfg.linear_value_head_dim}]"
        norms = [x for x in _decode_program(engine).splitlines() if "flipjax_gated_norm" in x]
        assert norms and all(f"= {half}" in x for x in norms)
    engine.check()
