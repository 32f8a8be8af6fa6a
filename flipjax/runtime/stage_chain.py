"""How a step runs through a binding's stages: cut into pieces, each piece through the chain.

Per stage, the model step then the slot write, with the hidden state handed to the next
stage's devices by `jax.device_put` (dispatch stays asynchronous). Under a pipeline a step is
cut into pieces (decode: micro-batches of rows; prefill: consecutive sub-chunks) so that stage
s works on piece i + 1 while stage s + 1 works on piece i. Single device and TP are the
one-stage case of the same chain. `StageChain` is a part of `Binding`, which holds the arrays
and looks the programs up; this file never compiles, places or keeps arrays of its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from flipjax.runtime import multihost
from flipjax.runtime.buckets import MIN_PREFILL_BUCKET
from flipjax.runtime.compile_counter import CompileCounter
from flipjax.runtime.crosshost import program_inputs, reshard, settle, to_leader
from flipjax.runtime.placement import StagePlacement

Shape = tuple[int, int]  # (rows, tokens per row) of one step
_concat = jax.jit(lambda parts: jnp.concatenate(parts, axis=0))
_concat_tokens = jax.jit(lambda parts: jnp.concatenate(parts, axis=1))


class StageChain:
    """A part of `Binding`'s API: the step, run over the arrays and programs the binding holds."""

    stages: tuple[StagePlacement, ...]
    compiles: CompileCounter
    hidden: bool  # the last stage also returns the hidden state at every position
    sampler_device: jax.Device
    _params: list[tuple[jax.Array, ...]]  # per stage, its parameters' leaves
    _kv: list[tuple[Any, ...]]  # per stage, its KV pools
    _gdn: list[tuple[Any, ...]]  # per stage, its GDN slot pools
    _inputs: list[NamedSharding]  # per stage, where its inputs go (replicated on its mesh)

    def _stage_programs(
        self, stage: int, shape: Shape, score: int | None = None, verify: bool = False
    ) -> tuple[Any, Any, bool]:
        """Stage `stage`'s (step, write, in place) for `shape`: the binding's, compiled once."""
        raise NotImplementedError

    def split(self, rows: int, tokens: int, verify: bool = False) -> tuple[int, int, int]:
        """How a pipeline cuts a [rows, tokens] step: (pieces, rows each, tokens each).

        A decode batch is cut into micro-batches of rows; a one-row prefill chunk into
        consecutive sub-chunks of at least `MIN_PREFILL_BUCKET`, each continuing the previous
        one's pages and GDN state. Either way stage s works on piece i + 1 while stage s + 1
        works on piece i. A single stage never cuts, and a verify step only into rows: its
        positions are one run of states (`chain`).
        """
        across = rows if rows > 1 or verify else tokens // MIN_PREFILL_BUCKET
        m = 1
        while m * 2 <= min(len(self.stages), across):
            m *= 2
        return (m, rows // m, tokens) if rows > 1 or verify else (m, 1, tokens // m)

    def run(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        table: np.ndarray,
        slots: np.ndarray,
        targets: np.ndarray | None = None,
        score: int | None = None,
        chain: np.ndarray | None = None,
    ) -> Any:
        """One step over [B, T] rows; returns logits [B, vocab] on the sampler's device. With
        `score` (top alternatives), also the `Scores` of `targets` [B, T]: (logits, scores).
        With `chain` [B, T], a verify step (`paged.stage_step`): logits [B, T, vocab]. A
        `hidden` binding pairs the result with the hidden states [B, T', hidden]."""
        b, t = tokens.shape
        verify = chain is not None
        m, rb, tb = self.split(b, t, verify)
        if rb < b:
            pieces = [(slice(j * rb, (j + 1) * rb), slice(None)) for j in range(m)]
        else:
            # Sub-chunks of one row: run up to the one holding the last real token, whose
            # logits are the step's; the rest are all padding.
            last = (int(np.sum(positions[0] >= 0)) - 1) // tb
            pieces = [(slice(None), slice(j * tb, (j + 1) * tb)) for j in range(max(last, 0) + 1)]
        outs, last = [], len(self.stages) - 1
        for rows, cols in pieces:
            x: Any = tokens[rows, cols]
            for s in range(len(self.stages)):
                scoring = score if s == last else None
                programs = self._stage_programs(s, (rb, tb), scoring, verify)
                host = [positions[rows, cols], table[rows], slots[rows]]
                if score is not None and s == last:
                    host.append(targets[rows, cols])
                if chain is not None:
                    host.append(chain[rows, cols])
                if s == 0:
                    host.insert(0, x)
                placed = program_inputs(tuple(host), self._inputs[s])
                if s == 0:
                    x, *placed = placed
                else:
                    x = reshard(x, self._inputs[s])  # the stage hand-off
                x = self._stage(s, programs, x, *placed, verify=verify)
            outs.append(jax.tree.map(lambda a: to_leader(a, self.sampler_device), x))
        if not multihost.current().leader:  # the others only take part in the programs
            return None
        if not self.hidden:
            return self._merged(outs, score, rb < b)
        hidden = outs[0][1]
        if len(outs) > 1:
            with self.compiles.watch():
                hidden = (_concat if rb < b else _concat_tokens)([h for _, h in outs])
        return self._merged([o for o, _ in outs], score, rb < b), hidden

    def _merged(self, outs: list[Any], score: int | None, by_rows: bool) -> Any:
        """The step's result from its pieces' (rows cut into micro-batches, or one row's
        sub-chunks, whose last piece holds the logits)."""
        if score is not None:  # one row in sub-chunks: the scores of every piece, in order
            with self.compiles.watch():
                scores = jax.tree.map(lambda *a: _concat_tokens(a), *(s for _, s in outs))
            return outs[-1][0], scores
        if not by_rows:
            return outs[-1]
        with self.compiles.watch():
            return _concat(outs)

    def run_sampled(
        self,
        tokens: jax.Array,
        positions: np.ndarray,
        table: np.ndarray,
        slots: np.ndarray,
        chain: np.ndarray | None = None,
    ) -> Any:
        """A step fed by `tokens` [B, T] still on device (a sampler's ids, or a verify step's
        with the head's drafts), so the host need not wait for them before it dispatches this
        step; one stage only (a pipeline cuts its steps on the host). Returns logits [B, vocab]
        on the sampler's device; with `chain`, a verify step's result as `run` returns it."""
        if len(self.stages) != 1:
            raise ValueError(f"run_sampled: one stage only, this placement has {len(self.stages)}")
        verify = chain is not None
        programs, where = self._stage_programs(0, tokens.shape, verify=verify), self._inputs[0]
        # Where the sampler's device is the stage's, the ids are already in place.
        x = tokens if tokens.sharding.is_equivalent_to(where, 2) else jax.device_put(tokens, where)
        host = (positions, table, slots) + ((chain,) if verify else ())
        out = self._stage(0, programs, x, *program_inputs(host, where), verify=verify)
        if verify:
            return jax.tree.map(lambda a: to_leader(a, self.sampler_device), out)
        logits = out[0] if self.hidden else out  # no head drafts from a step run ahead
        return to_leader(logits, self.sampler_device)

    def _stage(
        self,
        s: int,
        programs: tuple[Any, Any, bool],
        x: Any,
        pos: jax.Array,
        page_table: jax.Array,
        slot_ids: jax.Array,
        *extra: jax.Array,
        verify: bool = False,
    ) -> Any:
        """Stage `s`'s step and slot write on placed inputs; its output (hidden or logits). A
        verify step's states go to its chain (`extra`), not to the rows' slots."""
        step, write, in_place = programs
        x, kv, gdn = step(
            self._params[s], self._kv[s], self._gdn[s], x, pos, page_table, slot_ids, *extra
        )
        self._kv[s] = kv
        # In place, the step returned the updated pools and the rows' conv states.
        pools, new_rows = gdn if in_place else (self._gdn[s], gdn)
        # A step that updated every state in its slot left nothing to write: the write program
        # would only hand the pools back, for a dispatch each step (without it, the host's CPU
        # time per batch-8 decode step fell from 1.50 to 1.21 ms, the machine busy with it).
        if jax.tree.leaves(new_rows):
            pools = write(pools, extra[0] if verify else slot_ids, new_rows)
        self._gdn[s] = settle(pools)
        return x
