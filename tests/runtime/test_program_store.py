"""Stage programs read from the program store are the programs a trace makes, and a file is
used only in the trace environment that wrote it, and only when it can be trusted.

Each test points the store at a folder of its own and drops the process's programs first, so
its engines trace or read every step themselves. What needs no model (the key, the folder's
trust, the fallback) is checked on a small program of its own.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from flipjax import Engine
from flipjax.runtime import program_cache, program_store
from kernels_pallas import dispatch

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
TOY_KEY = ("toy", 1)
TOY_ARGS = (jax.ShapeDtypeStruct((4,), jnp.float32),)
OPTIONS = dict(max_running_requests=2, max_prefill_tokens=16)


@pytest.fixture
def store(tmp_path, monkeypatch):
    folder = tmp_path / "programs"
    monkeypatch.setenv(program_store.CACHE_ENV, str(folder))
    _forget_programs()
    yield folder
    _forget_programs()


def _forget_programs() -> None:
    program_cache.release()
    jax.clear_caches()
    gc.collect()


def _toy() -> None:
    """A small program compiled through the store, checked against numpy."""
    compiled = program_store.compile_program(TOY_KEY, _toy_step, {}, TOY_ARGS)
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(compiled(x)), x * 2 + 1)


def _toy_step(x: jax.Array) -> jax.Array:
    return x * 2 + 1


def _tokens(layout: str = "single") -> list[list[int]]:
    engine = Engine.from_pretrained("tiny", layout=layout, **OPTIONS)
    return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=6)]


def _programs_of_other_arguments(files: list) -> tuple:
    """Two kept programs whose arguments differ."""
    avals = {f: export.deserialize(bytearray(f.read_bytes())).in_avals for f in files}
    for f in files:
        for g in files:
            if avals[f] != avals[g]:
                return f, g
    raise AssertionError("every kept program takes the same arguments")


def _count_exports(monkeypatch) -> list[int]:
    """A list that grows by one each time a step is traced for export."""
    calls, export_fn = [], program_store.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return export_fn(*args, **kwargs)

    monkeypatch.setattr(program_store.export, "export", counted)
    return calls


@pytest.mark.parametrize("layout", ["tp:2", "pp:5,3"])
def test_steps_read_from_the_store_give_the_traced_steps_tokens(store, monkeypatch, layout):
    traced = _tokens(layout)
    kept = sorted(store.iterdir())
    assert kept, "nothing was kept"
    _forget_programs()
    with monkeypatch.context() as m:
        traces = _count_exports(m)
        assert _tokens(layout) == traced
    assert not traces, f"{len(traces)} steps were traced although the store held them"
    assert sorted(store.iterdir()) == kept


def test_each_thing_the_trace_reads_is_in_the_key(store, monkeypatch):
    """A step kept in one trace environment is not read in another: its file's name changes
    with the source, a variable the kernels read at trace time, the kernels' own choices and
    jax's trace-time configuration."""
    before = program_store._path(TOY_KEY, TOY_ARGS)
    assert before is not None
    form = "chunked" if dispatch.prefill_form() == "recurrent" else "recurrent"
    changes = {
        "the source": lambda m, _: m.setattr(program_store, "_sources", lambda: b"edited"),
        "FLIPJAX_GDN_PREFILL": lambda m, _: m.setenv("FLIPJAX_GDN_PREFILL", form),
        "the pinned prefill form": lambda _, stack: stack.enter_context(
            dispatch.kernels(dispatch.current_mode(), form)
        ),
        "jax's matmul precision": lambda _, stack: stack.enter_context(
            jax.default_matmul_precision("bfloat16")
        ),
        "the binding's key": lambda m, _: m.setattr(
            program_store, "_named", lambda key: repr(key) + "other"
        ),
    }
    for what, change in changes.items():
        with monkeypatch.context() as m, contextlib.ExitStack() as stack:
            change(m, stack)
            assert program_store._path(TOY_KEY, TOY_ARGS) != before, f"{what} is not keyed"
    assert program_store._path(TOY_KEY, TOY_ARGS) == before
    other_shape = (jax.ShapeDtypeStruct((5,), jnp.float32),)
    assert program_store._path(TOY_KEY, other_shape) != before


def test_files_that_cannot_be_trusted_are_traced_anew(store, monkeypatch, caplog):
    traced = _tokens()
    files = sorted(store.iterdir())
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    os.chmod(files[1], 0o666)  # writable by anyone
    other, mine = _programs_of_other_arguments(files[2:])
    mine.write_bytes(other.read_bytes())  # another program under this one's name
    _forget_programs()
    with caplog.at_level(logging.WARNING, logger=program_store.__name__):
        assert _tokens() == traced
    said = caplog.text
    assert "unreadable" in said
    assert "can be written by group or others" in said
    assert "takes other arguments" in said
    assert said.count("tracing anew") >= 3


def test_a_folder_others_can_write_is_not_read(store, monkeypatch, caplog):
    _toy()
    assert list(store.iterdir())
    os.chmod(store, 0o777)
    traces = _count_exports(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=program_store.__name__):
        _toy()
    assert traces, "a program was read from a folder anyone can write"
    assert "can be written by group or others" in caplog.text


def test_a_step_that_cannot_be_exported_is_compiled_as_it_is(store, monkeypatch, caplog):
    def cannot(*args, **kwargs):
        raise NotImplementedError("no export for this step")

    monkeypatch.setattr(program_store.export, "export", cannot)
    with caplog.at_level(logging.WARNING, logger=program_store.__name__):
        _toy()
    assert "cannot be exported (no export for this step); compiling it directly" in caplog.text
    assert not store.exists() or not list(store.iterdir())
