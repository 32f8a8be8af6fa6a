"""The engine: load a model, then serve requests by continuous batching over pooled state.

`Engine` is the narrow API the server, the benchmarks and library users call: construction,
requests (`add_request`, `step`, `progress`, `abort`, `generate`), layouts (`flip`, `arm`),
session checkpoints (`checkpoint_api`), and what it says about itself (`info`, `stats`,
`memory`: `memory_api`). Its parts (`assembly.Parts`) are private: nothing outside
`flipjax.engine` reaches into them.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from flipjax.config.tree import FlipjaxConfig
from flipjax.engine.assembly import Parts, assemble
from flipjax.engine.checkpoint_api import CheckpointAPI
from flipjax.engine.loader import load, model_fingerprint
from flipjax.engine.memory_api import MemoryAPI
from flipjax.engine.outputs import Output, Progress, StepStats, build_output, final_text
from flipjax.engine.outputs import prompt_logprobs as prompt_logprobs_of
from flipjax.engine.requests import check_salt
from flipjax.engine.sequence import Sequence
from flipjax.engine.snapshot import snapshot
from flipjax.engine.stats import EngineInfo, EngineStats
from flipjax.model.mtp import Qwen3NextMTP
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime import mirror, multihost
from flipjax.runtime.constraint import TokenConstraint
from flipjax.runtime.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from sharding.flip import FlipRecord
from store.checkpoints import CheckpointBook
from store.prefix import PrefixStore

__all__ = ["Engine", "Output", "StepStats"]


class Engine(CheckpointAPI, MemoryAPI):
    def __init__(
        self,
        model: Qwen3NextForCausalLM,
        tokenizer: Tokenizer,
        config: FlipjaxConfig | None = None,
        *,
        name: str = "model",
        prefix_store: PrefixStore | None = None,
        checkpoints: CheckpointBook | None = None,
        draft_head: Qwen3NextMTP | None = None,
    ):
        """An engine over `model` as `config` says (default: `FlipjaxConfig()`); `prefix_store`
        seeds and receives prefixes; `checkpoints` enables session checkpoints; speculation
        drafts with `draft_head` (default: the MTP head `model` was built with)."""
        config = config if config is not None else FlipjaxConfig()
        self._parts: Parts = assemble(
            model, tokenizer, config, prefix_store, checkpoints, draft_head
        )
        p = self._parts  # its config has the pool's page count settled
        self.info = EngineInfo(name, model.cfg, tokenizer, p.max_model_len, p.config)
        self._drained: list[Output] = []  # finished while an operation settled the batch
        self._last_step: StepStats | None = None
        self._closed = False
        if multihost.current().multi and multihost.current().leader:
            mirror.lead()  # every process built the same state; from here process 0 leads

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        config: FlipjaxConfig | None = None,
        *,
        prefix_store: PrefixStore | None = None,
        checkpoints: CheckpointBook | None = None,
        **options: Any,
    ) -> Engine:
        """`path`: a HF checkpoint folder, an orbax folder (`python -m flipjax.ckpt convert`),
        "flipjax-py" (`flipjax.model.shipped`) or "tiny" (`flipjax.engine.loader`). `options`
        set fields of `config` by name (`dtype`, `layout`, `num_pages`, ...: every field of
        `FlipjaxConfig`'s concerns)."""
        config = (config if config is not None else FlipjaxConfig()).replace(model=path, **options)
        facts = config.facts("model", "engine", "cache", "layout")
        multihost.agree({"weights": model_fingerprint(path), **facts})
        mc, drafts = config.model, config.speculative.draft_tokens > 0
        loaded = load(path, mc.dtype, config.layout.layout, mc.quantization, draft_head=drafts)
        return cls(
            loaded.model,
            loaded.tokenizer,
            config,
            name=loaded.name,
            prefix_store=prefix_store,
            checkpoints=checkpoints,
            draft_head=loaded.draft_head,
        )

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        max_new_tokens: int | None = DEFAULT_MAX_TOKENS,  # None: as many as fit
        session_id: str | None = None,
        chat: list[dict[str, str]] | None = None,
        n: int = 1,
        grammar: TokenConstraint | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Refusals raise ValueError and queue nothing. With
        `session_id` it is the session's next turn (after its tokens, unless the prompt was
        rendered from the whole conversation `chat`). `n` choices share one prefill
        (`progress(...).choices` has their ids); `grammar` constrains every token. Requests
        with a `cache_salt` (a tenant's) reuse prefixes only from requests with the same one."""
        self._check_open()
        p = self._parts
        params = sampling if sampling is not None else SamplingParams.greedy()
        ids = p.sessions.context(session_id, chat) + p.requests.encode(prompt)
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        check_salt(cache_salt)
        seq = Sequence("", ids, params, 0, seed, session_id=session_id, chat=chat, grammar=grammar)
        seq.cache_salt = cache_salt
        return p.requests.enqueue(seq, params, max_new_tokens, request_id, n)

    def has_unfinished(self) -> bool:
        """Whether a request is in flight, or finished and not yet returned by `step` (an
        operation between steps may have settled it)."""
        return self._parts.scheduler.has_work() or bool(self._drained)

    @property
    def last_step(self) -> StepStats | None:
        """What the last `step` did (cheap: read after every step by the serving loop)."""
        return self._last_step

    def step(self) -> list[Output]:
        """Run one scheduler step; returns the requests that finished in it (or, with a
        decode step run ahead, whose last token was taken in during it: `overlap`)."""
        p, t0 = self._parts, time.perf_counter()
        outputs, self._drained = self._drained, []
        rows = len(p.overlap.pending.rows) if p.overlap.pending else 0
        ahead = p.overlap.advance()
        if ahead is not None:
            outputs += [self._finish(s) for s in ahead]
            self._last_step = StepStats(self._layout(), 0, rows, time.perf_counter() - t0)
            return outputs
        outputs += [self._finish(s) for s in p.overlap.drain()]
        plan = p.scheduler.schedule()
        outputs += [self._finish(s) for s in p.scheduler.take_faulted()]
        outputs += [self._finish(s) for s in p.stepper.run(plan, p.overlap)]
        prefill = sum(c.length for c in plan.prefill)
        seconds = time.perf_counter() - t0
        self._last_step = StepStats(self._layout(), prefill, len(plan.decode), seconds)
        return outputs

    def progress(self, request_id: str, start: int = 0) -> Progress:
        """Where a request in flight stands: the ids (and logprobs) it generated from index
        `start` on, its choices and prompt size; KeyError when it is not in flight."""
        requests = self._parts.requests
        seq = requests[request_id]
        ids, logprobs = requests.generated(request_id, start)
        return Progress(
            request_id,
            ids,
            logprobs,
            tuple(requests.choices(request_id)),
            requests.prompt_tokens(request_id),
            seq.params,
            prompt_logprobs_of(seq) if start == 0 else None,
        )

    def abort(self, request_id: str) -> Output:
        """Stop a request now and free its pages and slot (its output, if it had finished)."""
        self._settle()
        done = [o for o in self._drained if o.request_id == request_id]
        if done:
            self._drained.remove(done[0])
            return done[0]
        seq = self._parts.requests[request_id]
        seq.finish_reason = "abort"
        return self._finish(seq)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        max_new_tokens: int = DEFAULT_MAX_TOKENS,
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Output]:
        """Run every prompt to completion; greedy unless `sampling` (one for all prompts or one
        each; its `max_tokens` wins) says otherwise. A refused prompt queues nothing."""
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, SamplingParams.each(sampling, prompts), strict=True):
                ids.append(self.add_request(prompt, params, max_new_tokens=max_new_tokens))
        except ValueError:
            for request_id in ids:
                self.abort(request_id)
            raise
        done: dict[str, Output] = {}
        while len(done) < len(ids):
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    # -- layouts --------------------------------------------------------------------------------

    def flip(self, layout: str, reseed: bool = False) -> FlipRecord | None:
        """Reshard the live state to `layout`; requests in flight continue where they are.
        Returns the `FlipRecord` (None if already there); a refused or failed flip raises and
        leaves the engine serving in its old layout. `reseed` drops the device prefix cache
        instead of moving it (the store serves those prefixes again)."""
        self._settle()
        p = self._parts
        return p.layouts.flip(layout, p.caches.reseed if reseed else None)

    def arm(self, layout: str) -> None:
        """Compile `layout`'s step programs now, so a later flip to it compiles nothing."""
        self._parts.layouts.arm(layout)

    def follow(self) -> int:
        """On a process other than 0 of a cluster: run process 0's device operations until it
        stops (returns how many ran); `ProcessLost` when it is gone."""
        p = self._parts
        return mirror.follow({"ModelRunner": p.runner, "Layouts": p.layouts})

    # -- pools, caches and what the engine says about itself ------------------------------------

    def stats(self) -> EngineStats:
        """A frozen snapshot of queues, pools, counters, layout and flips (between steps)."""
        return snapshot(self._parts, self._layout(), self._last_step)

    def check(self) -> None:
        """Prove every page and slot has one owner or is free; raises naming the culprit."""
        self._settle()
        self._parts.caches.check()

    def flush_prefix_cache(self) -> dict[str, int]:
        """Drop the device prefix cache (requests in flight keep what they use); the pages and
        states released."""
        self._settle()
        return self._parts.caches.flush()

    def warmup(self) -> None:
        """Compile every step shape now, so serving never compiles the model step later."""
        self._parts.caches.warmup(self._parts.runner)
        if (speculation := self._parts.stepper.speculation) is not None:
            speculation.warmup()

    def close(self) -> None:
        """Abort every request in flight and refuse new ones; pages and slots return to the
        pools. Idempotent."""
        if self._closed:
            return
        for request_id in self._parts.requests.ids():
            self.abort(request_id)
        self._drained.clear()
        self._closed = True

    # -- inside ---------------------------------------------------------------------------------

    def _layout(self) -> str:
        return self._parts.layouts.current

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: closed")

    def _settle(self) -> None:
        """Take in the ids of a decode step run ahead (waiting for them), so every request's
        state is whole; what finishes is returned by the next `step`. Every operation outside a
        step settles first."""
        self._drained += [self._finish(s) for s in self._parts.overlap.drain()]

    def _finish(self, seq: Sequence) -> Output:
        p = self._parts
        p.requests.finish(seq)
        if seq.error is not None:  # its text may be what failed; a failed turn is not recorded
            return build_output(seq, "")
        text = final_text(seq, self.info.tokenizer)
        p.sessions.record_turn(seq, text)
        return build_output(seq, text)
