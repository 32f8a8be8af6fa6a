"""The engine: load a model, then serve requests by continuous batching over pooled state.

`Engine` is the entry point the server, the tests and sharding experiments use:
`add_request` / `step` / `abort` drive it incrementally, `generate` runs a list of prompts to
completion. Requests share one pool of KV pages and GDN slots; a finished or aborted request
frees its ids at once. With a `prefix_store`, completed pages and grid GDN states are published
as soon as they are computed, and admitted requests start from the deepest stored prefix.
`prompt_logits` runs the contiguous reference forward, which is what the paged path is tested
against.
"""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.engine.config import EngineConfig
from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.radix_cache import RadixCache
from flipjax.engine.scheduler import Scheduler
from flipjax.engine.sequence import Sequence, TokenLogprob
from flipjax.engine.sessions import Session, capture, continuation
from flipjax.engine.stopping import append_token
from flipjax.model.config import ModelConfig
from flipjax.model.orbax_io import abstract_params, is_orbax, restore_params
from flipjax.model.qwen3_next import Qwen3NextForCausalLM, forward, init_cache
from flipjax.model.tiny import TINY_NAME, tiny_model
from flipjax.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from flipjax.model.weights import load_params
from flipjax.runtime import cache_io
from flipjax.runtime.buckets import pow2_bucket
from flipjax.runtime.cache import PagePool, SlotPool
from flipjax.runtime.model_runner import ModelRunner, Row
from flipjax.runtime.sampling import SamplerOutputs, SamplerRow, SamplingParams
from sharding.flip import FlipRecord, Layouts
from sharding.layout import placement_for
from store.checkpoints import CheckpointBook, CheckpointError
from store.prefix import PrefixStore

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass
class Output:
    """One request's result. `token_ids` holds the generated ids only."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "abort"
    logprobs: list[TokenLogprob] | None
    ttft_s: float | None  # arrival to first token
    e2e_s: float  # arrival to finish
    cached_tokens: int = 0  # prompt tokens taken from the prefix store, not computed


@dataclass(frozen=True)
class StepStats:
    """What the last step did, for throughput measurement (sampling syncs, so `seconds` is
    the step's real time)."""

    layout: str
    prefill_tokens: int
    decode_rows: int
    seconds: float


def parse_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


class Engine:
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
        self.pages = PagePool(ec.num_pages, "kv pages")
        self.slots = SlotPool(ec.slots, "gdn slots")
        self.prefix_store = prefix_store
        if prefix_store is not None and prefix_store.page_size != ec.page_size:
            raise ValueError(
                f"prefix_store: page size {prefix_store.page_size} is not the engine's "
                f"{ec.page_size}"
            )
        self.gdn_interval = _gdn_interval(ec, prefix_store)
        self.prefix_cache: RadixCache | None = None
        if ec.prefix_cache and ec.slots > ec.max_running_requests:
            self.prefix_cache = RadixCache(
                self.pages, self.slots, ec.page_size, self.gdn_interval,
                max_states=ec.slots - ec.max_running_requests,
            )  # fmt: skip
        reuse = self.prefix_cache is not None or prefix_store is not None
        self.scheduler = Scheduler(
            self.pages, self.slots, ec.page_size, ec.max_running_requests, ec.max_prefill_tokens,
            chunk_grid=self.gdn_interval if reuse else None, prefix_cache=self.prefix_cache,
        )  # fmt: skip
        self.max_model_len = ec.model_len(self.config)
        placement = placement_for(layout, self.config) if layout is not None else None
        self.runner = ModelRunner(
            self.config, self.graphdef, params, dtype, ec.page_size, ec.num_pages, ec.slots,
            self.max_model_len, ec.max_running_requests, ec.max_prefill_tokens, placement,
        )  # fmt: skip
        self.layouts = Layouts(self.runner, state_io=self._moves_state)
        self.reuse = PrefixReuse(
            self.runner, self.scheduler, ec.page_size, self.gdn_interval, self.prefix_cache,
            prefix_store,
        )  # fmt: skip
        self.scheduler.on_admit = self.reuse.seed
        self._requests: dict[str, Sequence] = {}
        self.checkpoints = checkpoints
        self.sessions: dict[str, Session] = {}
        self.last_step: StepStats | None = None
        self._ids = itertools.count()
        self._forward = jax.jit(
            functools.partial(forward, self.graphdef),
            static_argnames=("last_only",),
            donate_argnames=("cache",),
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype: str | jnp.dtype = "float32",
        layout: str | None = None,
        prefix_store: PrefixStore | None = None,
        checkpoints: CheckpointBook | None = None,
        **engine_options: int | None,
    ) -> Engine:
        """`path` is a HF checkpoint folder, an orbax folder written by `python -m flipjax.ckpt
        convert` (restored straight into the layout's shardings), or "tiny" for the embedded
        untrained model.

        `layout` places the state (`tp:2`, `pp:5,3`, ...; see `sharding.layout`); the default
        is one device. `prefix_store` seeds requests from stored prefixes and receives computed
        pages; `checkpoints` (a book over that store) enables session checkpoints.
        `engine_options` are `EngineConfig` fields (page_size, num_pages, ...).
        """
        jdtype = parse_dtype(dtype)
        ec = EngineConfig(**engine_options)
        if path == TINY_NAME:
            model = tiny_model(jdtype)
            return cls(
                model, ByteTokenizer(), TINY_NAME, jdtype, ec, prefix_store, layout, checkpoints
            )
        if not os.path.isdir(path):
            raise ValueError(f"model: {path!r} is neither a checkpoint folder nor {TINY_NAME!r}")
        cfg = ModelConfig.from_hf(path)
        graphdef, abstract = abstract_params(cfg, jdtype)
        if is_orbax(path):
            shardings = None
            if layout is not None:
                shardings = placement_for(layout, cfg).param_shardings(abstract)
            params = restore_params(path, cfg, abstract, shardings)
        else:
            params = load_params(path, cfg, abstract, jdtype)
        model = nnx.merge(graphdef, params)
        tokenizer = load_tokenizer(path, cfg.eos_token_id)
        name = os.path.basename(os.path.normpath(path))
        return cls(model, tokenizer, name, jdtype, ec, prefix_store, layout, checkpoints)

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

    def flip(self, layout: str) -> FlipRecord | None:
        """Reshard the live state to `layout`; requests in flight continue where they are.

        Returns the flip's `FlipRecord` (None if already there). A refused or failed flip
        raises and leaves the engine serving in its old layout.
        """
        return self.layouts.flip(layout)

    # -- inputs ---------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: is empty")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def _check_length(self, total: int) -> None:
        limit = self.max_model_len
        if total > limit:
            raise ValueError(f"max_tokens: {total} tokens in all exceed the context {limit}")

    # -- incremental API ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        max_new_tokens: int = 16,
        session_id: str | None = None,
        chat: list[dict[str, str]] | None = None,
    ) -> str:
        """Queue a request; returns its id. Refusals raise ValueError and queue nothing.

        With `session_id`, the request is the session's next turn: its prompt follows the
        session's tokens (unless `chat` is given: then the prompt was rendered from the whole
        conversation, `chat`), and the session takes its tokens when it finishes.
        """
        params = sampling if sampling is not None else SamplingParams.greedy()
        ids = self.encode_prompt(prompt)
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is not None and chat is None:
            ids = session.token_ids + ids
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        seq = Sequence("", ids, params, 0, seed, session_id=session_id, chat=chat)
        return self._enqueue(seq, params, max_new_tokens, request_id)

    def _enqueue(
        self, seq: Sequence, params: SamplingParams, max_new_tokens: int, request_id: str | None
    ) -> str:
        max_tokens = params.max_tokens if params.max_tokens is not None else max_new_tokens
        if max_tokens <= 0:
            name = "max_tokens" if params.max_tokens is not None else "max_new_tokens"
            raise ValueError(f"{name}: must be positive, got {max_tokens}")
        self._check_length(seq.num_tokens + max_tokens)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        seq.request_id, seq.max_tokens = request_id, seq.carried + max_tokens
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Output]:
        """Run one scheduler step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        finished: list[Sequence] = []
        for c in plan.prefill:
            row = Row(c.seq.all_ids[c.start : c.start + c.length], c.start, c.seq.pages, c.seq.slot)
            logits = self.runner.run([row], decode=False)
            c.seq.num_computed += c.length
            self.reuse.publish(c.seq, c.start)
            if c.completes_prompt:
                finished += self._sample(logits, [c.seq])
        if plan.decode:
            rows = [Row(s.all_ids[-1:], s.num_computed, s.pages, s.slot) for s in plan.decode]
            logits = self.runner.run(rows, decode=True)
            for s in plan.decode:
                s.num_computed += 1
                self.reuse.publish(s, s.num_computed - 1)
            finished += self._sample(logits, list(plan.decode))
        outputs = [self._finish(s) for s in finished]
        self.last_step = StepStats(
            self.layout, sum(c.length for c in plan.prefill), len(plan.decode),
            time.perf_counter() - t0,
        )  # fmt: skip
        return outputs

    def generated(self, request_id: str, start: int = 0) -> list[int]:
        """The token ids an in-flight request has generated from index `start` on (streams
        ask for what is new since their last read)."""
        seq = self._in_flight(request_id)
        return seq.output_ids[seq.carried + start :]

    def abort(self, request_id: str) -> Output:
        """Stop a request now and free its pages and slot."""
        seq = self._in_flight(request_id)
        seq.finish_reason = "abort"
        return self._finish(seq)

    def check(self) -> None:
        """Prove the pools' ledgers are consistent (free + owned == total) and agree with the
        prefix cache."""
        self.pages.check()
        self.slots.check()
        if self.prefix_cache is not None:
            self.prefix_cache.check()

    def pool_usage(self) -> dict[str, int]:
        """Pages and slots held by requests, and those only the prefix cache holds."""
        cache = self.prefix_cache
        cache_pages = cache.sole_pages() if cache is not None else 0
        cache_states = cache.num_states if cache is not None else 0
        return {
            "pages_requests": self.pages.total - self.pages.num_free - cache_pages,
            "pages_cache": cache_pages,
            "slots_requests": self.slots.total - self.slots.num_free - cache_states,
            "slots_cache": cache_states,
        }

    def flush_prefix_cache(self) -> dict[str, int]:
        """Drop the device prefix cache (requests in flight keep what they use); the store's
        tiers are untouched. Returns the pages and states released."""
        if self.prefix_cache is None:
            return {"pages": 0, "states": 0}
        pages, states = self.prefix_cache.flush()
        return {"pages": pages, "states": states}

    def warmup(self) -> None:
        """Compile every step shape now, so serving never compiles the model step later; with
        a prefix cache or store, also every program that moves pages and states."""
        self.runner.warmup()
        if self._moves_state:
            with self.runner.compiles.watch():
                self.runner.state = cache_io.warm(self.runner.state, self.runner.table_width)

    @property
    def prefix_counters(self) -> Counter[str]:
        """Admissions by where their prefix came from (hits_device, hits_host, hits_disk, or
        misses), and hit_tokens_* per tier."""
        return self.reuse.counters

    @property
    def _moves_state(self) -> bool:
        """Whether pages and states move between slots, the host and the device."""
        return self.prefix_cache is not None or self.prefix_store is not None

    @property
    def compile_count(self) -> int:
        return self.runner.compiles.count

    # -- sessions and checkpoints ---------------------------------------------------------------

    def checkpoint(
        self,
        request_id: str | None = None,
        session_id: str | None = None,
        position: int | None = None,
        quiesce: bool = False,
    ) -> dict[str, Any]:
        """Checkpoint a request in flight (only with `quiesce`: it is paused at this step
        boundary, checkpointed and resumes) or a session, at `position` tokens (default: all of
        them). Returns the checkpoint's summary; refusals raise CheckpointError or KeyError."""
        book = self._book()
        if (request_id is None) == (session_id is None):
            raise CheckpointError("checkpoint: name exactly one of request_id and session_id")
        if request_id is not None:
            seq = self._in_flight(request_id)
            if not quiesce:
                raise CheckpointError(
                    f"quiesce: request {request_id!r} is still generating; pass quiesce to "
                    "pause it at a step boundary for the checkpoint"
                )
            tokens, computed = seq.all_ids, seq.num_computed
            prompt_len, params, seed, chat = len(seq.prompt_ids), seq.params, seq.seed, seq.chat
        else:
            session = self.sessions.get(session_id)
            if session is None:
                raise KeyError(f"session_id: {session_id!r} is not a session")
            tokens, computed = session.token_ids, len(session.token_ids) - 1  # last one unfed
            prompt_len, params, seed = session.prompt_len, session.sampling, session.seed
            chat = session.chat
        return book.create(
            capture(tokens, computed, prompt_len, params, seed, chat, position, self.gdn_interval)
        )

    def branch(
        self,
        checkpoint_id: str,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 16,
        request_id: str | None = None,
        session_id: str | None = None,
        prompt: str | list[int] | None = None,
    ) -> str:
        """Queue a request that continues from a checkpoint; returns its id.

        Without `prompt` it continues the checkpointed generation exactly (same sampling and
        RNG state unless `sampling` overrides them); with one, the checkpoint's tokens become
        the context of a new turn. Every reference is verified before anything is seeded."""
        state = self._book().load(checkpoint_id)
        new_turn = self.encode_prompt(prompt) if prompt is not None else None
        seq = continuation(state, sampling, session_id, new_turn)
        return self._enqueue(seq, seq.params, max_new_tokens, request_id)

    def rewind(self, session_id: str, checkpoint_id: str) -> None:
        """Make `session_id` continue from a checkpoint (creating the session if need be)."""
        state = self._book().load(checkpoint_id)
        self.sessions[session_id] = Session(
            list(state.token_ids), state.prompt_len, state.sampling, state.seed, state.chat
        )

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return self._book().list()

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Unpin what the checkpoint referenced; KeyError when unknown."""
        self._book().delete(checkpoint_id)

    def sampling(self, request_id: str) -> SamplingParams:
        """The sampling parameters an in-flight request runs with."""
        seq = self._in_flight(request_id)
        return seq.params

    def _in_flight(self, request_id: str) -> Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise KeyError(f"request_id: {request_id!r} is not in flight")
        return seq

    def _book(self) -> CheckpointBook:
        if self.checkpoints is None:
            raise CheckpointError("checkpoint: this engine has no store to keep checkpoints in")
        return self.checkpoints

    # -- offline API ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        max_new_tokens: int = 16,
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Output]:
        """Run every prompt to completion; greedy unless `sampling` says otherwise.

        `sampling` is one SamplingParams for all prompts or one per prompt; its `max_tokens`
        wins over `max_new_tokens`. A refused prompt refuses the whole call, queuing nothing.
        """
        if isinstance(sampling, list):
            if len(sampling) != len(prompts):
                raise ValueError(
                    f"sampling: {len(sampling)} SamplingParams for {len(prompts)} prompts"
                )
            per_prompt = sampling
        else:
            per_prompt = [sampling] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, per_prompt, strict=True):
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
        if len(self.runner.binding.stages) > 1:
            raise ValueError(
                f"prompt_logits: runs the whole model in one program; flip from {self.layout} "
                "to a single-stage layout (single or tp) first"
            )
        ids = self.encode_prompt(token_ids)
        self._check_length(len(ids))
        width = pow2_bucket(len(ids), 16)
        tokens = np.zeros((1, width), np.int32)
        positions = np.full((1, width), -1, np.int32)
        tokens[0, : len(ids)] = ids
        positions[0, : len(ids)] = np.arange(len(ids))
        cache = init_cache(self.config, 1, width, self.dtype)
        logits, _ = self._forward(self.params, jnp.asarray(tokens), jnp.asarray(positions), cache)
        return np.asarray(logits[0, : len(ids)])

    # -- internals ------------------------------------------------------------------------------

    def _sample(self, logits: jax.Array, seqs: list[Sequence | None]) -> list[Sequence]:
        rows = [
            SamplerRow(s.params, s.seed, s.prompt_ids, s.output_ids) if s is not None else None
            for s in seqs
        ]
        out: SamplerOutputs = self.runner.sample(logits, rows)
        finished = []
        for i, seq in enumerate(seqs):
            if seq is None:
                continue
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

    def _finish(self, seq: Sequence) -> Output:
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        seq.finish_time = time.perf_counter()
        if not seq.params.stop or seq.finish_reason != "stop":
            seq.text = self.tokenizer.decode(seq.output_ids)
        new_ids = seq.output_ids[seq.carried :]
        text = seq.text
        if seq.carried:  # a branch answers with what it generated, not what it carried
            before = self.tokenizer.decode(seq.output_ids[: seq.carried])
            text = text[len(before) :] if text.startswith(before) else ""
        if seq.session_id is not None and seq.finish_reason != "abort":
            self.sessions[seq.session_id] = Session(
                seq.all_ids, len(seq.prompt_ids), seq.params, seq.seed,
                None if seq.chat is None else [*seq.chat, {"role": "assistant", "content": text}],
            )  # fmt: skip
        return Output(
            request_id=seq.request_id,
            prompt_token_ids=seq.all_ids[: len(seq.prompt_ids) + seq.carried],
            token_ids=new_ids,
            text=text,
            finish_reason=seq.finish_reason or "abort",
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            ttft_s=None
            if seq.first_token_time is None
            else seq.first_token_time - seq.arrival_time,
            e2e_s=seq.finish_time - seq.arrival_time,
            cached_tokens=seq.cached_tokens,
        )


def _gdn_interval(ec: EngineConfig, store: PrefixStore | None) -> int:
    """The GDN checkpoint grid: the configured one, else the store's, else the multiple of the
    page size nearest above 256 tokens."""
    if store is not None:
        if ec.gdn_checkpoint_interval not in (None, store.gdn_interval):
            raise ValueError(
                f"gdn_checkpoint_interval: {ec.gdn_checkpoint_interval} is not the prefix "
                f"store's {store.gdn_interval}"
            )
        return store.gdn_interval
    if ec.gdn_checkpoint_interval is not None:
        return ec.gdn_checkpoint_interval
    return -(-256 // ec.page_size) * ec.page_size
