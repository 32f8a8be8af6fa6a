"""The report's signature check: headers taken from held-out documents (dedented, decorators
and one-line bodies left out), a completion's body cut where its block ends, and `ast.parse`
the judge."""

from __future__ import annotations

import pytest

from flipjax.train.corpus import Document
from flipjax.train.report import Signature, function_source, held_out_signatures, parses

SOURCE = '''\
import os


@decorated
def first(a, b=1):
    """Docstring."""
    return a + b


class Thing:
    def method(
        self, x
    ):
        return x

    def one_liner(self): return 1

    async def later(self):
        await self.method(1)
'''


def test_headers_are_dedented_in_order_and_one_liners_are_left_out():
    docs = [Document("b.py", "def only():\n    pass\n"), Document("a.py", SOURCE)]
    found = held_out_signatures(docs, 4)
    assert [s.source for s in found] == ["a.py:5", "a.py:11", "a.py:18", "b.py:1"]
    assert found[1].text == "def method(\n    self, x\n):"
    assert found[2].text == "async def later(self):"
    for s in found:
        assert not parses(s, "", finished=True)  # a header alone is not a function
        assert parses(s, "\n    pass\n", finished=True)
    with pytest.raises(ValueError, match="fewer than 5"):
        held_out_signatures(docs, 5)


def test_the_body_ends_with_its_block_and_a_cut_last_line_is_dropped():
    sig = Signature("a.py:1", "def f(\n    a,\n):")
    completion = "  # comment\n    x = 1\n\n    return x\ndef next_one():\n    pass\n"
    header, body = function_source(sig, completion, finished=True)
    assert header == "def f(\n    a,\n):  # comment"
    assert body == "    x = 1\n\n    return x"
    assert function_source(sig, "\n    x = 1\n    return (x", finished=False)[1] == "    x = 1"
    assert function_source(sig, "\n    return (x", finished=True)[1] == "    return (x"
    # A method's body where a class would hold it, ended by the next method.
    method = Signature("a.py:2", "def m(self):")
    completion = "\n        if x:\n            return 1\n\n    def n(self):\n        pass\n"
    assert function_source(method, completion, finished=True)[1] == (
        "        if x:\n            return 1"
    )
    assert parses(method, completion, finished=True)
    assert not parses(method, "\n        if x:\n    return 1\n", finished=True)
    assert not parses(method, "\n        x = 1\n          y = 2\n", finished=True)


def test_parses_judges_the_header_and_body_together():
    sig = Signature("a.py:1", "def f(a):")
    assert parses(sig, "\n    return a\nprint(f(1))\n", finished=True)
    assert not parses(sig, "\n    return (a\n", finished=True)
    assert not parses(sig, "\nx = 1\n", finished=True)  # no body at all
    assert not parses(sig, " return a", finished=True)  # a one-liner is not a body
    assert not parses(sig, "\n    if a:\n", finished=True)
    assert parses(sig, "\n    if a:\n        return 1\n    return (", finished=False)
