"""The engine: load a model, then serve requests by continuous batching over pooled state.

`Engine` is the facade the server, the tests and sharding experiments use; it wires the parts
and delegates to them: requests (`requests`, `scheduler`, `step`), layouts (`sharding.flip`),
pools and caches (`caches`, `prefix_reuse`) and sessions (`sessions`).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.engine.caches import Caches
from flipjax.engine.checkpoint_api import CheckpointAPI
from flipjax.engine.config import EngineConfig
from flipjax.engine.loader import load, model_fingerprint
from flipjax.engine.outputs import Output, StepStats, build_output, final_text
from flipjax.engine.overlap import Overlap
from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.radix_cache import RadixCache
from flipjax.engine.reference import ContiguousForward
from flipjax.engine.requests import Requests
from flipjax.engine.scheduler import Scheduler
from flipjax.engine.sequence import Sequence
from flipjax.engine.sessions import Sessions
from flipjax.engine.step import Stepper
from flipjax.model.config import ModelConfig
from flipjax.model.dtypes import parse_dtype
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime import mirror, multihost
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.constraint import TokenConstraint
from flipjax.runtime.model_runner import ModelRunner
from flipjax.runtime.pools import PagePool, SlotPool
from flipjax.runtime.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from sharding.flip import FlipRecord, Layouts
from sharding.layout import placement_for
from store.checkpoints import CheckpointBook
from store.prefix import PrefixStore

__all__ = ["Engine", "Output", "StepStats"]


class Engine(CheckpointAPI):
    def __init__(
        self,
        model: Qwen3NextForCausalLM,
        tokenizer: Tokenizer,
        name: str,
        dtype: jnp.dtype,
        engine_config: EngineConfig | None = None,
        prefix_store: PrefixStore | None = None,
        layout: str | None = None,
        checkpoints: CheckpointBook | None = None,
    ):
        self.config: ModelConfig = model.cfg
        self.engine_config = ec = engine_config or EngineConfig()
        self.tokenizer = tokenizer
        self.name = name
        self.dtype = dtype
        self.graphdef, params = nnx.split(model)
        self.prefix_store = prefix_store
        self.gdn_interval = ec.gdn_interval(prefix_store)
        self.allocator = Allocator(ec.num_pages, ec.slots, ec.page_size)
        self.prefix_cache: RadixCache | None = None
        if ec.prefix_cache and ec.slots > ec.max_running_requests:
            self.prefix_cache = RadixCache(
                self.allocator, self.gdn_interval, max_states=ec.slots - ec.max_running_requests
            )
        moves_state = self.prefix_cache is not None or prefix_store is not None
        self.scheduler = Scheduler(
            self.allocator, ec.max_running_requests, ec.max_prefill_tokens,
            chunk_grid=self.gdn_interval if moves_state else None,
            prefix_cache=self.prefix_cache, prefetch_wait_s=ec.prefetch_wait_s,
        )  # fmt: skip
        self.max_model_len = max_len = ec.model_len(self.config)
        self.runner = ModelRunner(
            self.config, self.graphdef, params, dtype, ec.page_size, ec.num_pages, ec.slots,
            max_len, ec.max_running_requests, ec.max_prefill_tokens,
            placement_for(layout, self.config) if layout is not None else None,
        )  # fmt: skip
        self.layouts = Layouts(
            self.runner, self.allocator, moves_state, headroom=ec.flip_memory_headroom
        )
        self.reuse = PrefixReuse(
            self.runner, self.scheduler, ec.page_size, self.gdn_interval, self.prefix_cache,
            prefix_store,
        )  # fmt: skip
        self.scheduler.on_admit, self.scheduler.on_add = self.reuse.seed, self.reuse.prefetch
        self.caches = Caches(self.allocator, self.prefix_cache, self.reuse, moves_state)
        self.requests = Requests(tokenizer, self.config.vocab_size, max_len, self.scheduler)
        self.stepper = Stepper(self.runner, self.scheduler, self.reuse, tokenizer, max_len)
        self.overlap = Overlap(self.stepper, self.scheduler, self.runner, self.reuse, ec.overlap)
        self._drained: list[Output] = []  # finished while an operation settled the batch
        self.sessions = Sessions(checkpoints, self.gdn_interval)
        self.last_step: StepStats | None = None
        self._reference = ContiguousForward(self.graphdef, self.config, dtype)
        if multihost.current().multi and multihost.current().leader:
            mirror.lead()  # every process built the same state; from here process 0 leads

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: str | jnp.dtype = "float32", layout: str | None = None,
        prefix_store: PrefixStore | None = None, checkpoints: CheckpointBook | None = None,
        **engine_options: int | None,
    ) -> Engine:  # fmt: skip
        """`path`: a HF checkpoint folder, an orbax folder (`python -m flipjax.ckpt convert`),
        or "tiny" (`flipjax.engine.loader`). `layout` places the state (`tp:2`, `pp:5,3`, ...;
        default one device); `prefix_store` seeds and receives prefixes; `checkpoints` enables
        session checkpoints; `engine_options` are `EngineConfig` fields."""
        jdtype = parse_dtype(dtype)
        ec = EngineConfig(**engine_options)
        multihost.agree({"model": model_fingerprint(path), "dtype": str(jdtype),
                         "layout": layout, **vars(ec)})  # fmt: skip
        loaded = load(path, jdtype, layout)
        return cls(
            loaded.model, loaded.tokenizer, loaded.name, jdtype, ec, prefix_store, layout,
            checkpoints,
        )  # fmt: skip

    # -- layout ---------------------------------------------------------------------------------

    @property
    def params(self) -> nnx.State:
        """The parameters, wherever the current layout placed them (read through the binding)."""
        return self.runner.params

    @property
    def layout(self) -> str:
        """The current layout's text form: `single`, `tp:2`, `pp:5,3`, ..."""
        return self.layouts.current

    def arm(self, layout: str) -> None:
        """Compile `layout`'s step programs now, so a later flip to it compiles nothing."""
        self.layouts.arm(layout)

    def flip(self, layout: str, reseed: bool = False) -> FlipRecord | None:
        """Reshard the live state to `layout`; requests in flight continue where they are.
        Returns the `FlipRecord` (None if already there); a refused or failed flip raises and
        leaves the engine serving in its old layout. `reseed` drops the device prefix cache
        instead of moving it (the store serves those prefixes again)."""
        self.settle()
        return self.layouts.flip(layout, self.caches.reseed if reseed else None)

    # -- incremental API ------------------------------------------------------------------------

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
    ) -> str:
        """Queue a request; returns its id. Refusals raise ValueError and queue nothing. With
        `session_id` it is the session's next turn (after its tokens, unless the prompt was
        rendered from the whole conversation `chat`). `n` choices share one prefill
        (`requests.choices` has their ids); `grammar` constrains every token."""
        params = sampling if sampling is not None else SamplingParams.greedy()
        ids = self.sessions.context(session_id, chat) + self.requests.encode(prompt)
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        seq = Sequence("", ids, params, 0, seed, session_id=session_id, chat=chat, grammar=grammar)
        return self.requests.enqueue(seq, params, max_new_tokens, request_id, n)

    def follow(self) -> int:
        """On a process other than 0 of a cluster: run process 0's device operations until it
        stops (returns how many ran); `ProcessLost` when it is gone."""
        return mirror.follow({"ModelRunner": self.runner, "Layouts": self.layouts})

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Output]:
        """Run one scheduler step; returns the requests that finished in it (or, with a
        decode step run ahead, whose last token was taken in during it: `overlap`)."""
        t0 = time.perf_counter()
        outputs, self._drained = self._drained, []
        rows = len(self.overlap.pending.rows) if self.overlap.pending else 0
        ahead = self.overlap.advance()
        if ahead is not None:
            outputs += [self._finish(s) for s in ahead]
            self.last_step = StepStats(self.layout, 0, rows, time.perf_counter() - t0)
            return outputs
        outputs += [self._finish(s) for s in self.overlap.drain()]
        plan = self.scheduler.schedule()
        outputs += [self._finish(s) for s in self.stepper.run(plan, self.overlap)]
        self.last_step = StepStats(
            self.layout, sum(c.length for c in plan.prefill), len(plan.decode),
            time.perf_counter() - t0,
        )  # fmt: skip
        return outputs

    def settle(self) -> None:
        """Take in the ids of a decode step run ahead (waiting for them), so every request's
        state is whole; what finishes is returned by the next `step`. Every operation outside a
        step settles first."""
        self._drained += [self._finish(s) for s in self.overlap.drain()]

    def generated(self, request_id: str, start: int = 0) -> list[int]:
        """The ids an in-flight request generated from index `start` on (what is new)."""
        return self.requests.generated(request_id, start)[0]

    def abort(self, request_id: str) -> Output:
        """Stop a request now and free its pages and slot (its output, if it had finished)."""
        self.settle()
        done = [o for o in self._drained if o.request_id == request_id]
        if done:
            self._drained.remove(done[0])
            return done[0]
        seq = self.requests[request_id]
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

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits for every prompt position, [len(token_ids), vocab] float32 (contiguous path)."""
        ids = self.requests.encode(token_ids)
        self.requests.check_length(len(ids))
        return self._reference(self.runner.binding, ids)

    def _finish(self, seq: Sequence) -> Output:
        self.requests.finish(seq)
        text = final_text(seq, self.tokenizer)
        self.sessions.record_turn(seq, text)
        return build_output(seq, text)

    # -- pools and caches -----------------------------------------------------------------------

    @property
    def pages(self) -> PagePool:
        return self.allocator.pages

    @property
    def slots(self) -> SlotPool:
        return self.allocator.slots

    def check(self) -> None:
        self.settle()
        self.caches.check()

    def flush_prefix_cache(self) -> dict[str, int]:
        self.settle()
        return self.caches.flush()

    def warmup(self) -> None:
        self.caches.warmup(self.runner)

    @property
    def prefix_counters(self) -> Counter[str]:
        """Admissions by where their prefix came from (hits_device, hits_host, hits_disk, or
        misses), and hit_tokens_* per tier."""
        return self.reuse.counters

    @property
    def compile_count(self) -> int:
        return self.runner.compiles.count
