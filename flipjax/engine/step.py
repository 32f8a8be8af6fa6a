"""One engine step: the scheduler's plan through the runner, then sampling and stop checks.

Prefill chunks run in calls of a few requests' chunks of one length bucket (`prefill_calls`;
a call's rows are independent, so each gets the logits it would get alone, to the rounding of
a larger matmul) and decode rows run together; computed pages and grid states are published
as soon as each call returns (`PrefixReuse.publish`), and a chunk that completes its prompt is
sampled like a decode row, once for each of the prompt's parallel choices, which fork from it
there. A request that asked for prompt logprobs has them recorded chunk by chunk. Returns the
requests that finished.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from typing import Protocol

import jax
import jax.numpy as jnp

from flipjax.engine.faults import Faults
from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.scheduler import PrefillChunk, Scheduler, StepPlan
from flipjax.engine.sequence import Sequence, TokenLogprob
from flipjax.engine.speculation import Speculation
from flipjax.engine.stopping import append_token
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime.buckets import pow2_bucket, prefill_bucket
from flipjax.runtime.model_runner import ModelRunner, Row
from flipjax.runtime.paged import Scores
from flipjax.runtime.sampler import SamplerOutputs, SamplerRow

SeqRows = list[Sequence] | list[Sequence | None]


class RunsAhead(Protocol):
    """Takes a steady decode step's sampling over (`flipjax.engine.overlap.Overlap`)."""

    def launchable(self, plan: StepPlan) -> bool: ...

    def launch(self, logits: jax.Array, seqs: list[Sequence]) -> None: ...


class Stepper:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        reuse: PrefixReuse,
        tokenizer: Tokenizer,
        max_model_len: int,
        speculation: Speculation | None = None,
    ):
        self.runner = runner
        self.speculation = speculation
        self.scheduler = scheduler
        self.reuse = reuse
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.faults: Faults = scheduler.faults
        self.prefill_calls: Counter[int] = Counter()  # prefill calls, by their chunks

    def run(self, plan: StepPlan, overlap: RunsAhead | None = None) -> list[Sequence]:
        """Run `plan`; returns the requests that finished. With `overlap`, a steady decode
        step leaves its sampled ids on device for `overlap` to take in."""
        finished: list[Sequence] = []
        spec = self.speculation
        for call in prefill_calls(plan.prefill, self.runner.prefill_rows):
            finished += self.prefill(call)
        partial = {id(c.seq): c.seq for c in plan.prefill if c.seq.num_pending > 1}
        for seq in partial.values():  # after its last chunk of the step: a prefetch may have landed
            self.reuse.catch_up(seq)
        if plan.decode and spec is not None and spec.policy.speculate(len(plan.decode)):
            finished += spec.decode(self, plan.decode)
        elif plan.decode:
            t0 = time.perf_counter()
            rows = [Row(s.all_ids[-1:], s.num_computed, s.pages, s.slot) for s in plan.decode]
            logits = self.runner.run(rows, decode=True)
            if spec is not None:  # a speculative engine's steps return hidden states too
                logits, _ = logits
            for s in plan.decode:
                s.num_computed += 1
                self.publish(s, s.num_computed - 1)
            failed = [s for s in plan.decode if s.error is not None]
            finished += failed
            if not failed and overlap is not None and overlap.launchable(plan):
                overlap.launch(logits, plan.decode)  # its ids are taken in next step
            else:
                rows = [None if s.error is not None else s for s in plan.decode]
                finished += self.sample(logits, rows)
            if spec is not None:
                spec.after_plain_step(plan.decode, time.perf_counter() - t0)
        return finished

    def prefill(self, call: list[PrefillChunk]) -> list[Sequence]:
        """Run prompt chunks in one call (several requests' where `prefill_calls` put them
        together), publish their pages, and sample each chunk that completes its prompt;
        returns the requests that finished, or failed."""
        spec = self.speculation
        rows = [
            Row(c.seq.all_ids[c.start : c.start + c.length], c.start, c.seq.pages, c.seq.slot)
            for c in call
        ]
        first = call[0]
        self.prefill_calls[len(call)] += 1
        k = first.seq.params.prompt_logprobs  # a scoring chunk runs alone
        if k is None:
            logits = self.runner.run(rows, decode=False)
        else:
            rows[0].targets = first.seq.all_ids[first.start + 1 : first.start + first.length + 1]
            logits = self.runner.run(rows, False, pow2_bucket(k) if k else 0)
        if spec is not None:  # a speculating engine's calls are one chunk each
            logits, hidden = logits
        if k is not None:
            logits, scores = logits
            record_prompt_logprobs(first.seq, first.start, jax.device_get(scores), k)
        finished: list[Sequence] = []
        sampled: list[Sequence | None] = [None] * len(call)
        for i, c in enumerate(call):
            seq = c.seq
            seq.num_computed += c.length
            if not self.publish(seq, c.start):
                finished.append(seq)
                continue
            if not c.completes_prompt:
                if spec is not None:
                    spec.after_prefill(seq, c.start, c.length, hidden)
                continue
            group = [seq, *self.scheduler.release_forks(seq, self.reuse.fork)]
            if seq.max_tokens == seq.carried:  # scoring only: nothing to generate
                for s in group:
                    s.finish_reason = "length"
                finished += group
            elif len(group) > 1:
                with self.runner.compiles.watch():
                    choices = _repeat(logits, i, pow2_bucket(len(group)))
                finished += self.sample(choices, group)
            else:
                sampled[i] = seq
        if any(s is not None for s in sampled):
            finished += self.sample(logits, sampled)
        if spec is not None and first.completes_prompt and first.seq.error is None:
            # Drafting from the chunk's end needs the token sampled after it.
            spec.after_prefill(first.seq, first.start, first.length, hidden)
        return finished

    def publish(self, seq: Sequence, start: int) -> bool:
        """Publish `seq`'s pages computed from `start`; False if that failed it."""
        self.faults.guard(seq, "publishing", functools.partial(self.reuse.publish, seq, start))
        return seq.error is None

    def sample(self, logits: jax.Array, seqs: SeqRows) -> list[Sequence]:
        """Draw one token per row of `seqs` (None: a row to skip) and append it; returns the
        rows that finished, or failed."""
        out = self.launch(logits, seqs)
        return self.accept(fetched(out, seqs), seqs)

    def launch(self, logits: jax.Array, seqs: SeqRows) -> SamplerOutputs:
        """Dispatch drawing one token per row of `seqs` (None: a row to skip); the outputs
        stay on device. A row whose sampler input fails fails its request, and is skipped."""
        rows = [
            None
            if s is None or s.error is not None
            else self.faults.guard(s, "sampling", functools.partial(self.row, s))
            for s in seqs
        ]
        return self.runner.launch_sample(logits, rows)

    def accept(self, out: SamplerOutputs, seqs: SeqRows) -> list[Sequence]:
        """Append each row's drawn token (`out` on the host) to its request; returns the
        requests that finished."""
        finished = []
        for i, seq in enumerate(seqs):
            if seq is None:
                continue
            if seq.error is None:
                self.faults.guard(seq, "detokenizing", functools.partial(self.take, seq, out, i))
            if seq.finish_reason is not None:
                finished.append(seq)
        return finished

    def take(self, seq: Sequence, out: SamplerOutputs, i: int, token: int | None = None) -> None:
        """Append row `i`'s token (or `token`, a draft that row drew) to `seq`: its grammar,
        logprobs, text and stops."""
        token = int(out.tokens[i]) if token is None else token
        n = seq.params.logprobs
        lp = None
        if n is not None:
            top = list(
                zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist(), strict=True)
            )
            lp = TokenLogprob(token, float(out.logprob[i]), top)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        append_token(seq, token, lp, self.tokenizer, self.max_model_len)
        if seq.grammar is not None and seq.grammar.done and seq.finish_reason is None:
            seq.finish_reason = "stop"  # complete, and the model has no stop token

    def row(self, seq: Sequence, ahead: list[int] | None = None) -> SamplerRow:
        """The sampler's view of `seq`: its parameters, its bias (logit_bias, plus EOS and the
        stop ids held back until min_tokens) and its grammar's mask. With `ahead` (drafts a
        verify step checks), as it will be once they are appended."""
        params, output = seq.params, seq.output_ids + (ahead or [])
        bias = dict(params.logit_bias)
        if len(output) - seq.carried < params.min_tokens:
            for token in (*params.stop_token_ids, *self.tokenizer.eos_token_ids):
                bias[token] = -math.inf
        mask = seq.grammar.next_mask() if seq.grammar is not None else None
        return SamplerRow(params, seq.seed, seq.prompt_ids, output, bias or None, mask)


@functools.partial(jax.jit, static_argnums=2)
def _repeat(logits: jax.Array, row: int, rows: int) -> jax.Array:
    """Row `row` of `logits`, `rows` times: one prompt's logits for each of its choices."""
    return jnp.broadcast_to(jax.lax.dynamic_slice_in_dim(logits, row, 1), (rows, logits.shape[1]))


def prefill_calls(chunks: list[PrefillChunk], rows: dict[int, int]) -> list[list[PrefillChunk]]:
    """The plan's prompt chunks in calls, in order: a run of consecutive chunks of one length
    bucket, none of them scoring and no request twice (its later chunk continues the state its
    earlier one leaves), goes in calls of power-of-two sizes up to `rows[bucket]`, so no call
    computes a padding row; anything else goes alone."""
    calls: list[list[PrefillChunk]] = []
    run: list[PrefillChunk] = []

    def flush() -> None:
        while run:
            size = 1 << (len(run).bit_length() - 1)  # the largest power of two that fits
            calls.append(run[:size])
            del run[:size]

    for c in chunks:
        bucket = prefill_bucket(c.length)
        joins = (
            run
            and prefill_bucket(run[0].length) == bucket
            and all(r.seq is not c.seq for r in run)
            and len(run) < rows.get(bucket, 1)
        )
        if not joins:
            flush()
        if c.seq.params.prompt_logprobs is not None or rows.get(bucket, 1) == 1:
            calls.append([c])
            continue
        run.append(c)
    flush()
    return calls


def record_prompt_logprobs(seq: Sequence, start: int, scores: Scores, k: int) -> None:
    """Keep the logprob of each prompt token a chunk from `start` scored (the token at j is
    scored at position j - 1). Positions already kept, by a run before a retraction, stay."""
    for i in range(len(scores.chosen[0])):
        j = start + 1 + i
        if j >= len(seq.prompt_ids):
            break
        if j <= len(seq.prompt_logprobs):
            continue
        ids, lps = scores.top_ids[0, i, :k].tolist(), scores.top_logprobs[0, i, :k].tolist()
        top = list(zip(ids, lps, strict=True))
        seq.prompt_logprobs.append(TokenLogprob(seq.all_ids[j], float(scores.chosen[0, i]), top))


def fetched(out: SamplerOutputs, seqs: SeqRows) -> SamplerOutputs:
    """`out` with what `take` reads of it for `seqs` on the host: the ids, and the logprobs
    only where a row reports them (each array fetched costs a decode step's host thread a
    copy and a wait); the rest stays on the device."""
    if any(s is not None and s.params.logprobs is not None for s in seqs):
        return jax.device_get(out)
    return out._replace(tokens=jax.device_get(out.tokens))
