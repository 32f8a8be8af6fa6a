"""ModelRunner: owns the device state and runs bucketed, jitted model steps and the sampler.

Shapes are what make XLA compile, so they are kept to a small fixed set: a decode step is
[B, 1] with B a power of two up to max_running_requests; a prefill step is one request's chunk,
[1, T] with T a power of two up to max_prefill_tokens; the page table is always as wide as the
longest request allowed (attention walks only the blocks the batch needs). `warmup` compiles
that whole set, after which serving never compiles the model step; every compilation is
counted. The step functions are jitted once per process and keyed by (config, graphdef, kernel
mode), so engines over the same model share programs (see `jitted_step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.buckets import pages_for, pow2_bucket
from flipjax.cache import CacheState, init_cache_state
from flipjax.compile_counter import CompileCounter
from flipjax.config import ModelConfig
from flipjax.paged import model_step, write_slots
from flipjax.sampling import SamplerOutputs, SamplerRow, SamplingParams, build_inputs, sample
from kernels_pallas import dispatch

MIN_PREFILL_BUCKET = 16

_jitted_write_slots = jax.jit(write_slots, donate_argnums=(0,))


@functools.cache
def jitted_step(cfg: ModelConfig, graphdef: nnx.GraphDef, kernels: str) -> Callable[..., Any]:
    """The jitted step of one model structure and kernel mode, shared by every engine over it.

    Binding (cfg, graphdef) here rather than passing them as static arguments keeps their
    hashing (milliseconds for a graphdef) out of every step.
    """
    return jax.jit(functools.partial(model_step, cfg, graphdef, kernels), donate_argnums=(1,))


@dataclass
class Row:
    tokens: list[int]
    start: int  # position of tokens[0]
    pages: list[int]
    slot: int


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        dtype: jnp.dtype,
        page_size: int,
        num_pages: int,
        num_slots: int,
        max_model_len: int,
        max_running_requests: int,
        max_prefill_tokens: int,
    ):
        self.cfg = cfg
        self.graphdef = graphdef
        self.params = params
        self.num_slots = num_slots
        self.table_width = pages_for(max_model_len, page_size)
        self.decode_buckets = _pow2_range(1, max_running_requests)
        self.prefill_buckets = _pow2_range(MIN_PREFILL_BUCKET, max_prefill_tokens)
        self.state: CacheState = init_cache_state(cfg, num_pages, page_size, num_slots, dtype)
        self.compiles = CompileCounter()
        self.kernels = dispatch.current_mode()
        self._step = jitted_step(cfg, graphdef, self.kernels)

    def run(self, rows: list[Row], decode: bool) -> jax.Array:
        """Feed each row's tokens; returns logits at each row's last token, [B_bucket, vocab].

        Decode takes any number of rows with one token each; prefill takes exactly one row.
        """
        if decode:
            b, t = pow2_bucket(len(rows)), 1
        else:
            if len(rows) != 1:
                raise ValueError(f"prefill runs one request per call, got {len(rows)}")
            b, t = 1, pow2_bucket(len(rows[0].tokens), MIN_PREFILL_BUCKET)
        tokens = np.zeros((b, t), np.int32)
        positions = np.full((b, t), -1, np.int32)
        page_table = np.zeros((b, self.table_width), np.int32)
        slot_ids = np.full((b,), self.num_slots, np.int32)  # out of range: padding row
        for i, r in enumerate(rows):
            n = len(r.tokens)
            tokens[i, :n] = r.tokens
            positions[i, :n] = np.arange(r.start, r.start + n)
            page_table[i, : len(r.pages)] = r.pages
            slot_ids[i] = r.slot
        return self._run(tokens, positions, page_table, slot_ids)

    def sample(self, logits: jax.Array, rows: list[SamplerRow | None]) -> SamplerOutputs:
        inputs, flags = build_inputs(rows, logits.shape[0])
        with self.compiles.watch():
            out = sample(logits, inputs, **flags)
        return jax.device_get(out)

    def warmup(self) -> None:
        """Compile every step shape and the plain sampler variants, changing no state.

        All-padding inputs (position -1, slot out of range) write nothing, so this is safe at
        any time. Samplers with penalties or logprobs still compile on first use.
        """
        shapes = [(b, 1) for b in self.decode_buckets] + [(1, t) for t in self.prefill_buckets]
        for b, t in shapes:
            logits = self._run(
                np.zeros((b, t), np.int32),
                np.full((b, t), -1, np.int32),
                np.zeros((b, self.table_width), np.int32),
                np.full((b,), self.num_slots, np.int32),
            )
            if t == 1 or b == 1:
                for params in (SamplingParams.greedy(), SamplingParams(top_p=0.9)):
                    self.sample(logits, [SamplerRow(params, 0)])

    def _run(
        self, tokens: np.ndarray, positions: np.ndarray, table: np.ndarray, slots: np.ndarray
    ) -> jax.Array:
        slot_ids = jnp.asarray(slots)
        with self.compiles.watch():
            logits, kv, rows = self._step(
                self.params,
                self.state.kv,
                self.state.gdn,
                jnp.asarray(tokens),
                jnp.asarray(positions),
                jnp.asarray(table),
                slot_ids,
            )
            gdn = _jitted_write_slots(self.state.gdn, slot_ids, rows)
        self.state = CacheState(kv=kv, gdn=gdn)
        return logits


def _pow2_range(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out
