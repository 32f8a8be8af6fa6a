"""One engine step: the scheduler's plan through the runner, then sampling and stop checks.

Prefill chunks run one request per call and decode rows run together; computed pages and grid
states are published as soon as each call returns (`PrefixReuse.publish`), and a chunk that
completes its prompt is sampled like a decode row. Returns the requests that finished.
"""

from __future__ import annotations

import jax

from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.scheduler import StepPlan
from flipjax.engine.sequence import Sequence, TokenLogprob
from flipjax.engine.stopping import append_token
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime.model_runner import ModelRunner, Row
from flipjax.runtime.sampling import SamplerOutputs, SamplerRow


class Stepper:
    def __init__(
        self, runner: ModelRunner, reuse: PrefixReuse, tokenizer: Tokenizer, max_model_len: int
    ):
        self.runner = runner
        self.reuse = reuse
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def run(self, plan: StepPlan) -> list[Sequence]:
        finished: list[Sequence] = []
        for c in plan.prefill:
            row = Row(c.seq.all_ids[c.start : c.start + c.length], c.start, c.seq.pages, c.seq.slot)
            logits = self.runner.run([row], decode=False)
            c.seq.num_computed += c.length
            self.reuse.publish(c.seq, c.start)
            if c.completes_prompt:
                finished += self.sample(logits, [c.seq])
        if plan.decode:
            rows = [Row(s.all_ids[-1:], s.num_computed, s.pages, s.slot) for s in plan.decode]
            logits = self.runner.run(rows, decode=True)
            for s in plan.decode:
                s.num_computed += 1
                self.reuse.publish(s, s.num_computed - 1)
            finished += self.sample(logits, list(plan.decode))
        return finished

    def sample(self, logits: jax.Array, seqs: list[Sequence]) -> list[Sequence]:
        """Draw one token per row of `seqs` and append it; returns the rows that finished."""
        rows = [SamplerRow(s.params, s.seed, s.prompt_ids, s.output_ids) for s in seqs]
        out: SamplerOutputs = self.runner.sample(logits, rows)
        finished = []
        for i, seq in enumerate(seqs):
            n = seq.params.logprobs
            lp = None
            if n is not None:
                top = list(
                    zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist(), strict=True)
                )
                lp = TokenLogprob(int(out.tokens[i]), float(out.logprob[i]), top)
            append_token(seq, int(out.tokens[i]), lp, self.tokenizer, self.max_model_len)
            if seq.finish_reason is not None:
                finished.append(seq)
        return finished
