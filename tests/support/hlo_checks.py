"""Reading compiled programs: where an int8 weight is widened whole."""

from __future__ import annotations

import re


def widened_whole(hlo: str) -> list[str]:
    """The lines of a compiled program that widen a whole int8 weight: a convert whose result
    has the shape of one of the program's int8 parameters (a block of one is allowed: XLA's
    GEMM widens prefill's weights a block of columns at a time)."""
    entry = hlo[hlo.index("ENTRY") :].split("\n", 1)[0]
    weights = set(re.findall(r"s8\[([\d,]+)\]", entry))
    convert = re.compile(r"= \w+\[([\d,]*)\]\S* convert\(")
    return [line for line in hlo.splitlines() if (m := convert.search(line)) and m[1] in weights]
