"""The report's signature check: headers taken from held-out documents as written (methods
dedented, decorators and one-line bodies left out), a completion's body cut where the function
ends, and `ast.parse` the judge."""

from __future__ import annotations

import ast

import pytest

from flipjax.train.corpus import Document
from flipjax.train.report import Signature, completed_body, held_out_signatures, parses

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
    assert found[1].text == "def method(\n    self, x\n):\n"
    assert found[2].text == "async def later(self):\n"
    for s in found:
        with pytest.raises(SyntaxError):  # a header alone is not a function
            ast.parse(s.text)
        assert ast.parse(s.text + "    pass\n")
    with pytest.raises(ValueError, match="fewer than 5"):
        held_out_signatures(docs, 5)


def test_the_body_ends_at_column_zero_and_a_cut_last_line_is_dropped():
    completion = "    x = 1\n\n    return x\ndef next_one():\n    pass\n"
    assert completed_body(completion, finished=True) == "    x = 1\n\n    return x\n"
    assert completed_body("    x = 1\n    return (x", finished=False) == "    x = 1\n"
    assert completed_body("    return (x", finished=True) == "    return (x\n"


def test_parses_judges_the_header_and_body_together():
    sig = Signature("a.py:1", "def f(a):\n")
    assert parses(sig, "    return a\nprint(f(1))\n", finished=True)
    assert not parses(sig, "    return (a\n", finished=True)
    assert not parses(sig, "x = 1\n", finished=True)  # no body at all
    assert not parses(sig, "    if a:\n", finished=True)
    assert parses(sig, "    if a:\n        return 1\n    return (", finished=False)
