"""Speculative decoding: a step's decode rows drafted by the MTP head and verified at once.

Each decode row feeds its pending token and up to K drafts through one verify step
(`ModelRunner.verify`), which keeps the GDN state after every position in the slots the
request holds for that (`draft_slots`). The row's own sampler then draws the model's token at
every position as a plain decode step would draw it there: the same seed folded with the same
step, penalties over the same output, EOS held back by the same `min_tokens` count. A draft
stands while it equals that token; the first that differs is replaced by it. Committing is
then exact: the tokens appended, `num_computed` advanced by as many, the slot holding the GDN
state after the last of them made the request's slot (its old one becomes a draft slot: no
state is copied; K/V past it is overwritten by the next step), and the MTP head drafts again
from the hidden states of the positions just accepted.

Why this is speculative rejection sampling: the drafts are greedy (a draft x has probability
one under the draft), so the standard rule keeps x with probability min(1, p(x)) = p(x) and
otherwise draws from the residual, p without x, renormalised. Drawing y ~ p and keeping x iff
y = x does both at once, with y being the residual draw when it differs. Seeded, the tokens
are therefore those of decoding without drafts, token for token.

A request with a grammar decodes without drafts (its mask would have to follow each draft);
so does a row for which no draft slots, pages or tokens are left (`_allowance`).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from types import MappingProxyType
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.engine.device_drafts import DeviceDrafts
from flipjax.engine.faults import Faults
from flipjax.engine.sequence import Sequence
from flipjax.engine.speculation_policy import SpeculationPolicy
from flipjax.engine.stats import SpeculativeStats
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.buckets import pow2_bucket
from flipjax.runtime.drafter import Drafter
from flipjax.runtime.model_runner import ModelRunner, Row
from flipjax.runtime.sampler import SamplerOutputs, SamplerRow


class Steps(Protocol):
    """What speculation uses of the engine's stepper (`flipjax.engine.step.Stepper`)."""

    faults: Faults  # a request's own failure fails it alone

    def row(self, seq: Sequence, ahead: list[int]) -> SamplerRow: ...

    def take(self, seq: Sequence, out: SamplerOutputs, i: int, token: int | None) -> None: ...

    def publish(self, seq: Sequence, start: int) -> bool: ...


class Speculation:
    def __init__(
        self,
        runner: ModelRunner,
        drafter: Drafter,
        allocator: Allocator,
        max_model_len: int,
        policy: SpeculationPolicy,
        gdn_interval: int,
    ):
        self.runner = runner
        self.policy = policy
        self._last_end: float | None = None  # when the last decode step was recorded
        self.drafter = drafter
        self.on_device = DeviceDrafts()  # the last verify step's drafts, not yet fetched
        self.allocator = allocator
        self.num_steps = drafter.num_steps
        self.max_model_len = max_model_len
        self.gdn_interval = gdn_interval
        self.counters: Counter[str] = Counter()  # verify rows, drafted, accepted tokens
        self.accept_lengths: Counter[int] = Counter()  # tokens a row took in one step
        self.drafted_at = [0] * self.num_steps  # drafts checked at each draft position
        self.accepted_at = [0] * self.num_steps  # of which the model agreed with

    def decode(self, steps: Steps, seqs: list[Sequence]) -> list[Sequence]:
        """One verify step over the decode rows `seqs`; returns those that finished (or
        failed)."""
        t0 = time.perf_counter()
        self.drafter.fit(self.allocator.pages.total)
        fed = self._feeds(seqs)
        if not fed:
            self.on_device.fetch()
        allowed = [self._allowance(s) for s in seqs]
        # Drafts still on device stand in as zeros on the host: no sampler row reads their
        # values (`_feeds`: none of them has penalties), only how many there are.
        rows = [
            Row([s.all_ids[-1], *(s.drafts or [0] * k)[:k]], s.num_computed, s.pages, s.slot)
            for s, k in zip(seqs, allowed, strict=True)
        ]
        chains = [[*s.draft_slots[:k], s.slot] for s, k in zip(seqs, allowed, strict=True)]
        if fed:
            source = [self.on_device.row(s) for s in seqs]
            tokens, (logits, hidden) = self.runner.verify_fed(
                rows, chains, self.on_device.drafts, source
            )
            self.counters["fed"] += 1
        else:
            tokens, (logits, hidden) = self.runner.verify(rows, chains)
        width = self.num_steps + 1
        sampler_rows: list[SamplerRow | None] = []
        for s, r, k in zip(seqs, rows, allowed, strict=True):
            for i in range(width):
                row = None
                if i <= k and s.error is None:
                    ahead = functools.partial(steps.row, s, r.tokens[1 : i + 1])
                    row = steps.faults.guard(s, "sampling", ahead)
                sampler_rows.append(row)
        with self.runner.compiles.watch():  # as `ModelRunner.warmup` reshapes them
            flat = logits.reshape(-1, logits.shape[-1])
        sampled = self.runner.launch_sample(flat, sampler_rows)
        drafting = self._draft_verified(seqs, allowed, hidden, sampled.tokens, tokens)
        self.on_device.fetch()  # the drafts this step checked: made before it ran
        out = jax.device_get(sampled)  # the head drafts on the device meanwhile
        finished, taken = [], []
        for r, (s, k) in enumerate(zip(seqs, allowed, strict=True)):
            count = self._commit(steps, s, k, out, r * width) if s.error is None else 0
            taken.append(count)
            if s.error is not None or s.finish_reason is not None:
                finished.append(s)
        going = []
        for r, (s, n) in enumerate(zip(seqs, taken, strict=True)):
            s.drafts = []
            if n and s.error is None and s.finish_reason is None:
                going.append((s, r, n))
        self.on_device.hold(*drafting, going)  # fetched when the next step commits
        self._record(len(seqs), True, sum(taken), time.perf_counter() - t0)
        return finished

    def after_plain_step(self, seqs: list[Sequence], seconds: float) -> None:
        """The policy ran a decode step of `seqs` without drafts: their drafts are stale."""
        self.on_device.fetch()
        for s in seqs:
            s.drafts = []
        self._record(len(seqs), False, len(seqs), seconds)

    def _record(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """Tell the policy what a step took: the wall time since the last decode step, which
        counts the host's work around it (a plain step's runs ahead of it, a verify step's
        cannot), or after a pause between steps only the step's own `seconds`."""
        now = time.perf_counter()
        gap = now - self._last_end if self._last_end is not None else seconds
        self._last_end = now
        self.policy.record(rows, speculated, tokens, gap if gap < 3 * seconds + 5e-3 else seconds)

    def after_prefill(self, seq: Sequence, start: int, length: int, hidden: jax.Array) -> None:
        """Write the head's K/V over a prompt chunk just computed (the token after each of its
        positions known: the prompt's, or the first one sampled), drafting from its end."""
        if seq.error is not None or seq.finish_reason is not None:
            return
        if self.on_device.row(seq) >= 0:  # resumed after a preemption: they are stale
            self.on_device.fetch()
        self._draft(seq, start, seq.all_ids[start + 1 : start + length + 1], hidden)

    def warmup(self) -> None:
        """Compile the head's programs for every step shape (all padding: nothing written)."""
        runner, hidden = self.runner, self.runner.cfg.hidden_size
        prefill = set(runner.prefill_shapes)
        for b, t in runner.shapes:
            if t == 1:
                continue
            states = jnp.zeros((b, t, hidden), runner.binding.dtype, device=self.drafter.device)
            table = np.zeros((b, runner.table_width), np.int32)
            if (b, t) in prefill:
                positions = np.full((b, t), -1, np.int32)
                self.drafter.draft(states, positions.clip(0), positions, table)
            if t == runner.decode_tokens:
                sampled = jnp.zeros(b * t, jnp.int32, device=self.drafter.device)
                none = np.full(b, -1, np.int32)
                args = (np.zeros((b, t), np.int32), none, none.clip(0), table)
                jax.block_until_ready(self.drafter.draft_verified(states, sampled, *args))

    def stats(self) -> SpeculativeStats:
        """Accept lengths (histogram) and acceptance per draft position, a snapshot."""
        return SpeculativeStats(
            num_steps=self.num_steps,
            verify_rows=self.counters["rows"],
            drafted=self.counters["drafted"],
            accepted=self.counters["accepted"],
            accept_lengths=MappingProxyType(dict(sorted(self.accept_lengths.items()))),
            drafted_at=tuple(self.drafted_at),
            accepted_at=tuple(self.accepted_at),
            plain_steps=self.policy.counters["plain"],
            switches=self.policy.counters["switches"],
        )

    # -- inside ---------------------------------------------------------------------------------

    def _allowance(self, seq: Sequence) -> int:
        """How many of `seq`'s drafts this step may check: none with a grammar; no more than
        its tokens left allow past the pending one, nor its context; none past the next GDN
        grid point, so that a step that reaches it ends there and its state is published
        (`PrefixReuse.publish` keeps states on the grid); no more than it has draft slots and
        pages for (taken here, when free)."""
        drafts = self.on_device.count(seq)
        if seq.grammar is not None or not drafts:
            return 0
        left = min(seq.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens + 1)
        to_grid = self.gdn_interval - seq.num_computed % self.gdn_interval
        k = max(0, min(drafts, self.num_steps, left - 1, to_grid - 1))
        missing = k - len(seq.draft_slots)
        if missing > 0 and not self.allocator.take_draft_slots(seq, missing):
            k = len(seq.draft_slots)
        while k and not self.allocator.grow(seq, seq.num_tokens + k):
            k -= 1
        return k

    def _commit(self, steps: Steps, seq: Sequence, k: int, out: SamplerOutputs, at: int) -> int:
        """Take row `seq`'s tokens from the sampler's rows at..at+k: the drafts the model
        agrees with and its own next one, up to a stop; returns how many were taken."""
        agreed = 0
        while agreed < k and int(out.tokens[at + agreed]) == seq.drafts[agreed]:
            agreed += 1
        start, taken = seq.num_computed, 0
        for i in range(agreed + 1):  # the drafts agreed with, then the model's own draw
            draft = seq.drafts[i] if i < agreed else None
            take = functools.partial(steps.take, seq, out, at + i, draft)
            steps.faults.guard(seq, "detokenizing", take)
            taken += 1
            if seq.error is not None or seq.finish_reason is not None:
                break
        if seq.error is not None:
            return 0
        if taken <= k:  # the state after its last token is in draft slot taken - 1
            self.allocator.promote_draft_slot(seq, taken - 1)
        seq.num_computed = start + taken
        steps.publish(seq, start)
        self.counters["rows"] += 1
        self.counters["drafted"] += k
        self.counters["accepted"] += agreed
        self.accept_lengths[taken] += 1
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < agreed
        return taken

    def _feeds(self, seqs: list[Sequence]) -> bool:
        """Whether this verify step takes the drafts held on device as they are: on one process
        and stage (`ModelRunner.overlaps`), in a batch of the bucket they were made in, and
        with no penalties on a row that has them (its sampler row needs their values)."""
        drafts = self.on_device.drafts
        if drafts is None or not self.runner.overlaps:
            return False
        if drafts.shape[0] != pow2_bucket(len(seqs)):
            return False
        return not any(self.on_device.row(s) >= 0 and s.params.uses_penalties for s in seqs)

    def _draft_verified(
        self,
        seqs: list[Sequence],
        allowed: list[int],
        hidden: jax.Array,
        sampled: jax.Array,
        tokens: jax.Array | np.ndarray,
    ) -> tuple[jax.Array, jax.Array]:
        """Dispatch the head's drafts after the verify step of `tokens` just sampled, from
        every row's accepted positions (`Drafter.draft_verified`): (drafts, tokens taken), on
        device."""
        b = hidden.shape[0]
        starts = np.full(b, -1, np.int32)
        counts = np.zeros(b, np.int32)
        table = np.zeros((b, self.runner.table_width), np.int32)
        for r, (s, k) in enumerate(zip(seqs, allowed, strict=True)):
            if s.error is not None:
                continue
            starts[r], counts[r] = s.num_computed, k
            table[r, : len(s.pages)] = s.pages
        return self.drafter.draft_verified(hidden, sampled, tokens, starts, counts, table)

    def _draft(self, seq: Sequence, start: int, following: list[int], hidden: jax.Array) -> None:
        """Run the head over `seq`'s positions from `start`, one per token in `following` (the
        token after each), writing its K/V there, and keep the drafts after the last."""
        b, t = hidden.shape[:2]
        n = len(following)
        positions = np.full((b, t), -1, np.int32)
        after = np.zeros((b, t), np.int32)
        table = np.zeros((b, self.runner.table_width), np.int32)
        positions[0, :n] = np.arange(start, start + n)
        after[0, :n] = following
        table[0, : len(seq.pages)] = seq.pages
        seq.drafts = []
        if n:
            seq.drafts = [int(x) for x in self.drafter.draft(hidden, after, positions, table)[0]]
