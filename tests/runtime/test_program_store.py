"""Stage programs read from the program store are the programs a trace makes, and a file is
used only in the trace environment that wrote it, and only when it can be trusted.

Each test points the store at a folder of its own and drops the process's programs first, so
its engines trace or read every step themselves.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import jax
import pytest
from jax import export

from flipjax import Engine
from flipjax.runtime import program_cache, program_store

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
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
    """A step kept in one trace environment is not read in another: the source, a variable the
    kernels read at trace time, jax's trace-time configuration."""
    _tokens()
    changes = {
        "the source": lambda m, _: m.setattr(program_store, "_sources", lambda: b"edited"),
        "FLIPJAX_GDN_PREFILL": lambda m, _: m.setenv("FLIPJAX_GDN_PREFILL", "chunked"),
        "jax's matmul precision": lambda _, stack: stack.enter_context(
            jax.default_matmul_precision("bfloat16")
        ),
    }
    for what, change in changes.items():
        kept = set(store.iterdir())
        _forget_programs()
        with monkeypatch.context() as m, contextlib.ExitStack() as stack:
            change(m, stack)
            _tokens()
        assert set(store.iterdir()) - kept, f"a step traced before {what} changed was read"


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
    traced = _tokens()
    os.chmod(store, 0o777)
    _forget_programs()
    with caplog.at_level(logging.WARNING, logger=program_store.__name__):
        assert _tokens() == traced
    assert "can be written by group or others" in caplog.text


def test_a_step_that_cannot_be_exported_is_compiled_as_it_is(store, monkeypatch, caplog):
    traced = _tokens()
    _forget_programs()
    for kept in store.iterdir():
        kept.unlink()

    def cannot(*args, **kwargs):
        raise NotImplementedError("no export for this step")

    monkeypatch.setattr(program_store.export, "export", cannot)
    with caplog.at_level(logging.WARNING, logger=program_store.__name__):
        assert _tokens() == traced
    assert "cannot be exported (no export for this step); compiling it directly" in caplog.text
    assert not list(store.iterdir())
