"""ModelRunner: turns rows into bucketed step inputs, runs them through the bound placement,
and samples.

Shapes are what make XLA compile, so they are kept to a small fixed set: a decode step is
[B, 1] with B a power of two up to max_running_requests; a prefill step is one request's chunk,
[1, T] with T a power of two up to max_prefill_tokens, or the chunks of several requests of one
such T, [B, T] with B a power of two up to max_prefill_rows (`buckets.prefill_rows`; not in a
speculative engine, whose head drafts per prefill shape); the page table is always as wide as the
longest request allowed (attention walks only the blocks the batch needs). `warmup` compiles
that whole set, after which serving never compiles the model step; every compilation is
counted. The state and the step programs are reached through `self.binding` (see
`flipjax.runtime.binding`), the one object a layout flip swaps; programs are cached per process, so
engines over the same model and placement share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.runtime import cache_io, host_memory, multihost
from flipjax.runtime.binding import Binding
from flipjax.runtime.buckets import pages_for, pow2_bucket, pow2_range, prefill_bucket
from flipjax.runtime.cache import CacheState
from flipjax.runtime.compile_counter import CompileCounter
from flipjax.runtime.crosshost import on_device
from flipjax.runtime.draft_feed import fed_tokens
from flipjax.runtime.host_image import HostImage
from flipjax.runtime.host_pages import HostPages
from flipjax.runtime.mirror import mirrored
from flipjax.runtime.placement import Placement, single_device
from flipjax.runtime.plan_codec import carried
from flipjax.runtime.runner_shape import RunnerShape
from flipjax.runtime.sampler import (
    SamplerOutputs,
    SamplerRow,
    bitmask_words,
    build_inputs,
    sample,
)
from flipjax.runtime.sampling import SamplingParams
from flipjax.runtime.stages import ModelParts
from kernels_pallas import dispatch


@carried
@dataclass
class Row:
    tokens: list[int]
    start: int  # position of tokens[0]
    pages: list[int]
    slot: int
    targets: list[int] | None = None  # the token after each of `tokens`, to score (prefill)


class ModelRunner:
    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        shape: RunnerShape,
        placement: Placement | None = None,
    ):
        host_memory.keep_freed_buffers()  # the step's temporaries reuse memory, not fault it in
        self.cfg = cfg = shape.cfg
        self.graphdef = graphdef
        self.num_slots = shape.num_slots
        self.table_width = pages_for(shape.max_model_len, shape.page_size)
        self.decode_buckets = pow2_range(1, shape.max_running_requests)
        # A speculative engine decodes by verify steps of K + 1 positions per row.
        self.decode_tokens = shape.speculative_tokens + 1
        self.prefill_rows = shape.prefill_rows()  # prefill bucket -> most rows a call takes
        self.compiles = CompileCounter()
        self.kernels = dispatch.current_mode()
        self.parts = ModelParts.of(graphdef, params)
        pools = shape.pools()
        # Every placement of the weights (this one, a flip's, a failed flip's way back) is
        # written from this host copy; None where the weights span processes.
        self.image = HostImage.of(params)
        self.binding = Binding.place(
            placement or single_device(cfg),
            params,
            self.image,
            pools,
            cfg=cfg,
            parts=self.parts,
            kernels=self.kernels,
            dtype=shape.dtype,
            table_width=self.table_width,
            compiles=self.compiles,
            hidden=shape.speculative_tokens > 0,
        )

    @property
    def params(self) -> nnx.State:
        return self.binding.params

    @property
    def state(self) -> CacheState:
        return self.binding.state

    @state.setter
    def state(self, state: CacheState) -> None:
        self.binding.state = state

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every step shape serving uses: the decode, verify (speculating) and prefill buckets."""
        decode = [(b, 1) for b in self.decode_buckets]
        if self.decode_tokens > 1:
            decode += [(b, self.decode_tokens) for b in self.decode_buckets]
        return decode + self.prefill_shapes

    @property
    def prefill_shapes(self) -> list[tuple[int, int]]:
        """The prefill buckets, (rows, tokens)."""
        return [(b, t) for t, n in self.prefill_rows.items() for b in pow2_range(1, n)]

    @mirrored
    def run(self, rows: list[Row], decode: bool, score: int | None = None) -> Any:
        """Feed each row's tokens; returns logits at each row's last token, [B_bucket, vocab]
        (on process 0 of a cluster; None on the others).

        Decode takes any number of rows with one token each; prefill takes one row, or as
        many as `prefill_rows` allows for the bucket of its longest (scoring: one row). With
        `score` (top alternatives, a power of two or 0), a prefill row also gets the logprobs
        of its `targets`: (logits, `Scores`). A speculative engine's result comes paired with
        the hidden states at every position: (result, [B, T, hidden]).
        """
        if decode:
            b, t = pow2_bucket(len(rows)), 1
        else:
            b = pow2_bucket(len(rows))
            t = prefill_bucket(max(len(r.tokens) for r in rows))
            most = 1 if score is not None else self.prefill_rows.get(t, 1)
            if len(rows) > most:
                raise ValueError(f"prefill of {len(rows)} rows of {t} tokens: at most {most}")
        tokens, positions, page_table, slot_ids = self._inputs(rows, b, t)
        targets = np.full((b, t), -1, np.int32) if score is not None else None
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
            if targets is not None and r.targets is not None:
                targets[i, : len(r.targets)] = r.targets
        return self.binding.run(tokens, positions, page_table, slot_ids, targets, score)

    @mirrored
    def verify(self, rows: list[Row], chains: list[list[int]]) -> tuple[np.ndarray, Any]:
        """A verify step of each row's pending token and drafts, the GDN state after token i
        kept in slot `chains[r][i]`: (tokens [B_bucket, K + 1], (logits, hidden states))."""
        tokens, positions, page_table, slot_ids, chain = self._verify_inputs(rows, chains)
        return tokens, self.binding.run(tokens, positions, page_table, slot_ids, chain=chain)

    def verify_fed(
        self, rows: list[Row], chains: list[list[int]], drafts: jax.Array, source: list[int]
    ) -> tuple[jax.Array, Any]:
        """`verify` where row i's drafts are row `source[i]` of `drafts` [B, K], the head's
        still on device (-1: its `tokens` as given; either way as many as it has tokens after
        the first): (the step's tokens [B, K + 1] on device, its result). Single process, one
        stage (`overlaps`)."""
        tokens, positions, page_table, slot_ids, chain = self._verify_inputs(rows, chains)
        b = tokens.shape[0]
        counts = np.array([len(r.tokens) - 1 for r in rows] + [0] * (b - len(rows)), np.int32)
        rows_of = np.array([*source, *[-1] * (b - len(source))], np.int32)
        with self.compiles.watch():
            drafts = on_device(drafts, self.binding.sampler_device)
            fed = fed_tokens(tokens, drafts, rows_of, counts)
        return fed, self.binding.run_sampled(fed, positions, page_table, slot_ids, chain)

    def _verify_inputs(self, rows: list[Row], chains: list[list[int]]) -> tuple[np.ndarray, ...]:
        b, t = pow2_bucket(len(rows)), self.decode_tokens
        tokens, positions, page_table, slot_ids = self._inputs(rows, b, t)
        chain = np.full((b, t), self.num_slots, np.int32)
        for i, (r, c) in enumerate(zip(rows, chains, strict=True)):
            if not 1 <= len(r.tokens) == len(c) <= t:
                raise ValueError(f"verify: row {i} has {len(r.tokens)} tokens, {len(c)} slots")
            tokens[i, : len(r.tokens)] = r.tokens
            chain[i, : len(c)] = c
        return tokens, positions, page_table, slot_ids, chain

    def run_sampled(self, tokens: jax.Array, rows: list[Row]) -> jax.Array:
        """A decode step of `rows` (their `tokens` unused) fed by `tokens`, the ids a
        `launch_sample` drew for the same rows, before they reach the host: logits as `run`.
        Single process, one stage (`overlaps`)."""
        _, positions, page_table, slot_ids = self._inputs(rows, tokens.shape[0], 1)
        with self.compiles.watch():
            column = _column(tokens)
        return self.binding.run_sampled(column, positions, page_table, slot_ids)

    @property
    def overlaps(self) -> bool:
        """Whether a decode step can be fed by the previous one's sampled ids on device: on
        one process (the others could not see them) and one stage."""
        return not multihost.current().multi and len(self.binding.stages) == 1

    def sample(self, logits: jax.Array, rows: list[SamplerRow | None]) -> SamplerOutputs:
        return jax.device_get(self.launch_sample(logits, rows))

    def launch_sample(self, logits: jax.Array, rows: list[SamplerRow | None]) -> SamplerOutputs:
        """Dispatch sampling one token per row of `logits` (None: a padding row); the outputs
        stay on device until fetched."""
        inputs, flags = build_inputs(rows, *logits.shape)
        with self.compiles.watch():
            return sample(logits, inputs, **flags)

    @mirrored
    def warmup(self) -> None:
        """Compile every step shape and the plain sampler variants, changing no state.

        All-padding inputs (position -1, slot out of range) write nothing, so this is safe at
        any time. The samplers warmed are greedy and top-p, each with and without a grammar
        mask; those with penalties, biases or logprobs still compile on first use.
        """
        for b, t in self.shapes:
            verify = 1 < t == self.decode_tokens
            logits = self.binding.run(
                np.zeros((b, t), np.int32),
                np.full((b, t), -1, np.int32),
                np.zeros((b, self.table_width), np.int32),
                np.full((b,), self.num_slots, np.int32),
                chain=np.full((b, t), self.num_slots, np.int32) if verify else None,
            )
            if self.binding.hidden:
                logits, _ = logits
                logits = logits.reshape(-1, logits.shape[-1]) if verify else logits
            if (t == 1 or verify) and self.overlaps:  # steps fed by ids still on device
                with self.compiles.watch():
                    zeros = jnp.zeros((b, t), jnp.int32, device=self.binding.sampler_device)
                    if t == 1:
                        jax.block_until_ready(_column(zeros[:, 0]))
                    else:
                        rows = np.zeros(b, np.int32)  # the step's tokens from the host:
                        fed = fed_tokens(np.asarray(zeros), zeros[:, 1:], rows, rows)  # as run
                        jax.block_until_ready(fed)
            # Sampling runs on process 0 only.
            if (t == 1 or verify or b == 1) and multihost.current().leader:
                allowed = np.full(bitmask_words(logits.shape[1]), -1, np.int32)
                for params in (SamplingParams.greedy(), SamplingParams(top_p=0.9)):
                    for mask in (None, allowed):  # rows without and with a grammar
                        self.sample(logits, [SamplerRow(params, 0, mask=mask)])

    # -- moving pooled state (the prefix cache and the store; see `cache_io`) --------------------

    @mirrored
    def read_pages(self, pages: list[int]) -> HostPages:
        with self.compiles.watch():
            return cache_io.read_pages(self.state, pages)

    @mirrored
    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        with self.compiles.watch():
            return cache_io.read_slot(self.state, slot)

    @mirrored
    def write(
        self, pages: list[int], kv: HostPages, slot: int, rec: np.ndarray, conv: np.ndarray
    ) -> None:
        """Write stored pages of KV and a GDN state (into `slot`) where a request resumes."""
        with self.compiles.watch():
            state = cache_io.write_pages(self.state, pages, kv)
            self.state = cache_io.write_slot(state, slot, rec, conv)

    @mirrored
    def copy_slot(self, src: int, dst: int) -> None:
        with self.compiles.watch():
            self.state = cache_io.copy_slot(self.state, src, dst)

    @mirrored
    def copy_page(self, src: int, dst: int) -> None:
        with self.compiles.watch():
            self.state = cache_io.copy_page(self.state, src, dst)

    @mirrored
    def warm_state_io(self) -> None:
        """Compile every program that moves pages and states, changing nothing."""
        with self.compiles.watch():
            self.state = cache_io.warm(self.state, self.table_width)

    def _inputs(
        self, rows: list[Row], b: int, t: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """[b, t] tokens (zeros, for the caller to fill), positions, page table and slots of
        `rows`, padded to the bucket: position -1 and an out-of-range slot write nothing."""
        tokens = np.zeros((b, t), np.int32)
        positions = np.full((b, t), -1, np.int32)
        page_table = np.zeros((b, self.table_width), np.int32)
        slot_ids = np.full((b,), self.num_slots, np.int32)
        for i, r in enumerate(rows):
            n = max(len(r.tokens), 1)  # a `run_sampled` row has no ids yet: its one position
            positions[i, :n] = np.arange(r.start, r.start + n)
            page_table[i, : len(r.pages)] = r.pages
            slot_ids[i] = r.slot
        return tokens, positions, page_table, slot_ids


_column = jax.jit(lambda tokens: tokens[:, None])  # a sampler's [B] ids as a step's [B, 1]
