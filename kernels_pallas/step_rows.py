"""How many positions each row of the step being traced has, for choices made by row count.

A speculative verify step multiplies K + 1 positions per row where a decode step multiplies
one. Paths chosen by row count (the native matmul or XLA's dot) must be the same for both, or a
row's product would be rounded one way in one and another way in the other, and speculation
would change tokens. Inside `positions_per_row(n)` those choices take `decode_rows(rows)`: the
rows of the decode step the verify step stands for. The native matmul computes each row alike
whatever the batch (its tests check it), so the choice is all that could differ.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_positions: contextvars.ContextVar[int] = contextvars.ContextVar("positions_per_row", default=1)


@contextlib.contextmanager
def positions_per_row(n: int) -> Iterator[None]:
    token = _positions.set(n)
    try:
        yield
    finally:
        _positions.reset(token)


def decode_rows(rows: int) -> int:
    """The rows of the decode step that a step of `rows` rows (positions) stands for."""
    return max(1, rows // _positions.get())
