"""A schema's `pattern`, checked and rewritten for xgrammar's regex compiler in JSON-string mode.

xgrammar writes what a pattern matches into the JSON string as it is: a `"`, a `\\` or a
control character the pattern admits comes out raw, which is not JSON. A non-ASCII character
written as itself beside `.` or a negated class lets those admit control characters
(`é|.`); `\\U` escapes are read as letters; a `?` after a group lets parts of the group be
skipped (`^a(xy+)?b$` admits "ayb"); lookaround is ignored; counted repetitions past 128
(`^a*c{129}$`) go wrong. So a pattern is refused where it needs what xgrammar lacks, and
otherwise rewritten into the same language, or the part of it without `"`, `\\` and control
characters: non-ASCII characters as `\\u` escapes, those characters taken out of classes,
`(...)?` as `(...){0,1}`. The output is still held to the client's pattern.
"""

from __future__ import annotations

import re

MAX_PATTERN_REPEAT = 128
# What JSON writes escaped, so that xgrammar must never emit it: U+0000..U+001F, " and \.
_FORBIDDEN = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_CLASS_ESCAPES = "dDwWsS"
_CHAR_ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "a": 7}
_HEX = {"x": 2, "u": 4, "U": 8}
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def xgrammar_pattern(pattern: object, path: str) -> str:
    """`pattern` as xgrammar should compile it; ValueError naming `path` where it cannot."""
    if not isinstance(pattern, str):
        raise ValueError(f"{path}: must be a string")
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{path}: not a valid regular expression: {err}") from None
    for m in _REPEAT.finditer(pattern.replace("\\\\", "")):
        if max(int(n) for n in m.groups() if n) > MAX_PATTERN_REPEAT:
            raise ValueError(
                f"{path}: a repetition {m.group()} past {MAX_PATTERN_REPEAT} is not supported"
            )
    return _Rewrite(pattern, path).run()


class _Rewrite:
    def __init__(self, pattern: str, path: str):
        self.p = pattern
        self.path = path
        self.i = 0

    def refuse(self, what: str) -> None:
        raise ValueError(f"{self.path}: {what} is not supported")

    def run(self) -> str:
        out = []
        while self.i < len(self.p):
            ch = self.p[self.i]
            if ch == "\\":
                out.append(self.escape_text(in_class=False))
            elif ch == "[":
                out.append(self.char_class())
            elif self.p.startswith("(?", self.i) and not self.p.startswith("(?:", self.i):
                self.refuse(f"{self.p[self.i : self.i + 4]!r} (lookaround, flags, named groups)")
            elif ch == ")" and self.p.startswith(")?", self.i):
                out.append("){0,1}")
                self.i += 2
            else:
                out.append(ch if ord(ch) < 0x80 else _char(ord(ch)))
                self.check_char(ord(ch))
                self.i += 1
        return "".join(out)

    def check_char(self, code: int) -> None:
        if any(lo <= code <= hi for lo, hi in _FORBIDDEN):
            self.refuse(f"matching {chr(code)!r} (JSON escapes it; the grammar would not)")

    def escape(self) -> tuple[str, int | None]:
        """The escape at `i`, past it: (its text, its code point; None for a class escape)."""
        e = self.p[self.i + 1]
        if e in _CLASS_ESCAPES:
            self.i += 2
            return "\\" + e, None
        if e in _HEX:
            n = _HEX[e]
            code = int(self.p[self.i + 2 : self.i + 2 + n], 16)
            self.i += 2 + n
            return _char(code), code
        if e in _CHAR_ESCAPES:
            self.i += 2
            return "", _CHAR_ESCAPES[e]
        if e.isalnum():
            self.refuse(f"the escape \\{e}")
        self.i += 2
        return ("\\" + e if ord(e) < 0x80 else _char(ord(e))), ord(e)

    def escape_text(self, in_class: bool) -> str:
        text, code = self.escape()
        if code is not None and not in_class:
            self.check_char(code)
        return text

    def char_class(self) -> str:
        """The class at `i`, past it, without the characters JSON escapes."""
        self.i += 1
        negated = self.p.startswith("^", self.i)
        self.i += negated
        ranges: list[tuple[int, int]] = []
        escapes: list[str] = []
        first = True
        while first or self.p[self.i] != "]":
            lo = self.member(escapes)
            if lo is not None and self.p.startswith("-", self.i) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.member(escapes)
                ranges.append((lo, lo if hi is None else hi))
            elif lo is not None:
                ranges.append((lo, lo))
            first = False
        self.i += 1
        if negated:
            ranges += _FORBIDDEN
        else:
            ranges = [r for lo, hi in ranges for r in _without_forbidden(lo, hi)]
            if not ranges and not escapes:
                self.refuse("a class of only characters JSON escapes")
        body = "".join(_char(lo) + ("-" + _char(hi) if hi > lo else "") for lo, hi in ranges)
        return "[" + "^" * negated + body + "".join(escapes) + "]"

    def member(self, escapes: list[str]) -> int | None:
        """One member of a class: its code point, or None for a class escape (kept)."""
        if self.p[self.i] == "\\":
            text, code = self.escape()
            if code is None:
                escapes.append(text)
            return code
        self.i += 1
        return ord(self.p[self.i - 1])


def _without_forbidden(lo: int, hi: int) -> list[tuple[int, int]]:
    parts = [(lo, hi)]
    for f_lo, f_hi in _FORBIDDEN:
        parts = [
            piece
            for a, b in parts
            for piece in ((a, min(b, f_lo - 1)), (max(a, f_hi + 1), b))
            if piece[0] <= piece[1]
        ]
    return parts


def _char(code: int) -> str:
    """A character as xgrammar's regex reads it whatever it is."""
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}"
