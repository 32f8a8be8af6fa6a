"""Structured-output compiles are bounded: a spec too large or too deep is refused before it
compiles, compiles run on the compiler's own threads with at most `max_pending` waiting, one
spec in flight compiles once, and a request gives up on a compile after the server's timeout
with a 400 while the compile finishes (and is cached) on its own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from flipjax.config.tree import ServeConfig
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.grammar import (
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    GrammarBusy,
    GrammarCompiler,
    nesting_depth,
)
from serve.errors import APIError
from serve.structured import compile_spec
from tests.support.schemas import nested_array_schema
from tests.support.servers import ROOT


def compiler(**kw) -> GrammarCompiler:
    tokenizer = ByteTokenizer()
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, **kw)


def occupy(grammars: GrammarCompiler) -> threading.Event:
    """Holds each of the compiler's threads until the returned event is set."""
    release = threading.Event()
    for _ in range(grammars._threads._max_workers):
        grammars._threads.submit(release.wait, 60)
    return release


def test_nesting_depth_counts_brackets_outside_strings():
    assert nesting_depth('{"a": [1, {"b": "x"}]}') == 3
    assert nesting_depth('{"pattern": "^[a-z]{1,8}(x)$"}') == 1  # inside a string: not nesting
    assert nesting_depth(r'{"p": "\"[[[["}') == 1  # an escaped quote does not end the string
    assert nesting_depth("((a|b)[cd])") == 2
    assert nesting_depth("[" * 100_000) == 100_000  # a scan: no recursion limit


def test_a_spec_too_deep_or_too_large_is_refused_before_it_compiles():
    grammars = compiler()
    deep = nested_array_schema(MAX_SPEC_DEPTH + 1)
    with pytest.raises(ValueError, match=r"guided_json: .* nests 65 levels deep; at most 64"):
        grammars.compile("json", deep, "guided_json")
    with pytest.raises(ValueError, match=rf"guided_regex: .* at most {MAX_SPEC_BYTES}"):
        grammars.compile("regex", "a" * (MAX_SPEC_BYTES + 1), "guided_regex")
    assert grammars.counters["too_large"] == 2 and grammars.counters["compiled"] == 0
    # At the bound it compiles, in bounded time (not asserted: machines differ).
    t0 = time.perf_counter()
    grammars.compile("json", nested_array_schema(MAX_SPEC_DEPTH), "guided_json")
    print(f"a schema {MAX_SPEC_DEPTH} levels deep compiled in {time.perf_counter() - t0:.2f} s")
    assert grammars.counters["compiled"] == 1


def test_one_spec_in_flight_compiles_once_and_a_full_queue_is_busy():
    grammars = compiler(threads=1, max_pending=2)
    release = occupy(grammars)
    a = grammars.submit("regex", "[a-z]{3}", "guided_regex")
    assert grammars.submit("regex", "[a-z]{3}", "guided_regex") is a  # shared, not queued again
    b = grammars.submit("choice", ["yes", "no"], "guided_choice")
    with pytest.raises(GrammarBusy, match=r"guided_json: 2 grammars are compiling"):
        grammars.submit("json", {"type": "object"}, "guided_json")
    release.set()
    a.result(60), b.result(60)
    assert grammars.counters["shared"] == 1 and grammars.counters["busy"] == 1
    assert grammars.counters["compiled"] == 2
    # The queue drained: the refused spec compiles now, and the first is a cache hit.
    grammars.compile("json", {"type": "object"}, "guided_json")
    assert grammars.submit("regex", "[a-z]{3}", "guided_regex").done()
    assert grammars.counters["hits"] == 1


def _state(grammars: GrammarCompiler, timeout_s: float) -> SimpleNamespace:
    config = ServeConfig(grammar_timeout_s=timeout_s)
    return SimpleNamespace(grammars=grammars, grammar_lock=asyncio.Lock(), config=config)


def test_a_request_gives_up_after_the_timeout_and_the_compile_is_cached():
    grammars = compiler(threads=1)
    release = occupy(grammars)
    spec = ("regex", "[0-9]{4}", "guided_regex")
    with pytest.raises(APIError) as refused:
        asyncio.run(compile_spec(_state(grammars, 0.2), spec))
    assert refused.value.status == 400 and refused.value.param == "guided_regex"
    assert "did not compile within 0.2 s" in refused.value.message
    assert grammars.counters["timed_out"] == 1
    # Given up on, not cancelled: another request for the spec joins the same compile.
    joined = grammars.submit(*spec)
    assert grammars.counters["shared"] == 1
    release.set()
    joined.result(60)
    make = asyncio.run(compile_spec(_state(grammars, 30), spec))  # the same compile, finished
    assert make() is not None and grammars.counters["compiled"] == 1


def test_a_busy_compiler_is_a_503_naming_the_field():
    grammars = compiler(threads=1, max_pending=1)
    release = occupy(grammars)
    grammars.submit("regex", "x+", "guided_regex")
    with pytest.raises(APIError) as busy:
        asyncio.run(compile_spec(_state(grammars, 30), ("regex", "y+", "guided_regex")))
    release.set()
    assert busy.value.status == 503 and busy.value.param == "guided_regex"


def test_a_server_loads_xgrammar_on_its_first_structured_request_not_at_start():
    """xgrammar brings torch (about 2.5 s of every start); the server's modules load neither."""
    code = (
        "import sys, flipjax.serve, serve.app, flipjax.engine.engine, serve.structured\n"
        "print(sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
