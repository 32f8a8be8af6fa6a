"""What the sampler needs from a structured-output constraint, stated without naming a grammar
engine: the bitmask of tokens allowed next, and the token that was chosen. The xgrammar-backed
implementation is `flipjax.runtime.grammar`; importing this module costs nothing."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenConstraint(Protocol):
    def next_mask(self) -> np.ndarray:
        """[ceil(vocab / 32)] int32: bit t % 32 of word t // 32 allows token t."""

    def accept(self, token: int) -> None:
        """Advance past `token`, which the last mask allowed."""

    def fork(self) -> TokenConstraint:
        """An independent copy at the same point (for parallel choices of one prompt)."""

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
