"""The MTP head's drafts while they are still on the device.

A verify step's drafts for the next step are made on the device right behind its sampler
(`Drafter.draft_verified`). The next verify step takes them there (`ModelRunner.verify_fed`),
so the host dispatches it while the head still runs, and fetches them only to commit that
step's tokens, by when they are long done. Anything else that needs a request's drafts on the
host fetches them first (`fetch`). Fetching checks that each row's drafts were made after as
many tokens as the host committed for it (the device finds that count from the sampled tokens
itself): a difference would mean drafts made from the wrong positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from flipjax.engine.sequence import Sequence


@dataclass(frozen=True)
class _Row:
    seq: Sequence
    row: int  # its row of the drafts
    taken: int  # the tokens the host committed for it in the step that drafted


class DeviceDrafts:
    def __init__(self) -> None:
        self._drafts: jax.Array | None = None  # [B, K]
        self._took: jax.Array | None = None  # [B]: the tokens each row's drafts came after
        self._rows: dict[int, _Row] = {}  # by id of the request

    @property
    def drafts(self) -> jax.Array | None:
        return self._drafts

    def hold(
        self, drafts: jax.Array, took: jax.Array, rows: list[tuple[Sequence, int, int]]
    ) -> None:
        """Keep a step's drafts [B, K] and counts [B] on device for `rows` (request, its row,
        the tokens the host committed for it), which have no drafts on the host until fetched;
        any drafts held before are fetched first."""
        self.fetch()
        if rows:
            self._drafts, self._took = drafts, took
            self._rows = {id(s): _Row(s, row, taken) for s, row, taken in rows}

    def row(self, seq: Sequence) -> int:
        """`seq`'s row of the drafts held, or -1 where none are held for it."""
        held = self._rows.get(id(seq))
        return held.row if held is not None and held.seq is seq else -1

    def count(self, seq: Sequence) -> int:
        """How many drafts `seq` has: on the host, or held here."""
        return len(seq.drafts) or (self._drafts.shape[1] if self.row(seq) >= 0 else 0)

    def fetch(self) -> None:
        """Give every request held its drafts on the host."""
        if not self._rows:
            return
        drafts, took = jax.device_get((self._drafts, self._took))
        rows, self._rows, self._drafts, self._took = self._rows, {}, None, None
        for r in rows.values():
            if took[r.row] != r.taken:
                raise RuntimeError(
                    f"speculation: request {r.seq.request_id} took {r.taken} tokens, its "
                    f"drafts were made after {took[r.row]}"
                )
            r.seq.drafts = [int(x) for x in drafts[r.row]]
