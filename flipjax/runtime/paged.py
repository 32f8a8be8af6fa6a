"""The engine's model step over pooled state: paged KV for attention, slots for GDN state.

A step runs per stage (one stage unless the layout is a pipeline), and each stage is two
programs. `stage_step` reads the GDN slots, runs the model, writes new K/V into
the pages (in place, donated) and returns the rows' new GDN states; `write_slots` then puts
those rows back into the slot pools (in place, donated). The split is deliberate: in one
program XLA fuses the slot gather into several consumers and, to keep the pool readable while
updating it in place, copies every GDN pool on every step. Where the native decode kernel runs
(`updates_in_place`) the recurrent states are not gathered: the kernel updates each row's state
in its slot of the (donated) pool, the step returns the pools, and `write_slots` writes only
the rows' conv states (gathered, so for the same reason written by the second program), unless
the native conv runs too (`conv_in_place`: fp32 on one device), which reads and writes each
row's conv window in its slot as well, leaving `write_slots` nothing to write.

Rows are requests; a row's tokens continue its cached prefix (a decode row has one token, a
prefill row a chunk). A row whose first position is 0 starts from a zero GDN state, so a
recycled slot never leaks its previous owner's state. Padding rows carry slot id `num_slots`
and position -1: their reads are zeros and their writes are dropped.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from flipjax.model.config import FULL_ATTENTION, ModelConfig
from flipjax.model.gated_deltanet import Columns, GDNState, causal_conv
from flipjax.runtime.cache import GDNSlots, KVPages
from flipjax.runtime.chained_gdn import ChainedGDN
from flipjax.runtime.stages import ModelParts, StageParams, StageSpan, stage_forward
from kernels_pallas import dispatch, head_parallel, step_rows
from kernels_pallas.paged_attention.pages import write_pages


class PagedKV(NamedTuple):
    """Attention cache for one layer: its pages (`KVPages`) and the batch's page tables
    [B, max_pages]."""

    pages: KVPages
    page_table: jax.Array

    def update_and_attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, PagedKV]:
        old, table = self.pages, self.page_table
        writer = dispatch.page_writer()
        pages = KVPages(
            *write_pages(old.k, old.v, k, v, table, positions, old.k_scale, old.v_scale, writer)
        )
        out = dispatch.paged_attention(
            q, pages.k, pages.v, self.page_table, positions, pages.k_scale, pages.v_scale
        )
        return out, PagedKV(pages, self.page_table)


class PooledGDN(NamedTuple):
    """A GDN layer's cache in a step: its pool of recurrent states, the slot each row reads and
    the one it writes, and the rows' conv states, or (`conv_pool`) the pool of conv states the
    native conv reads and writes in place. A read out of the pool's range (padding, or a row
    that starts at position 0) is a zero state; a write out of range is dropped."""

    pool: jax.Array  # [S, Hv, dk, dv]
    reads: jax.Array  # [B]
    writes: jax.Array  # [B]
    conv: jax.Array | None  # [B, K-1, conv_dim]
    conv_pool: jax.Array | None = None  # [S, K-1, conv_dim]

    def advance(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """The delta rule over the rows' tokens from their pooled states: o and, where the
        native kernel runs, the updated pool, otherwise the rows' new states [B, ...]."""
        native = dispatch.pooled_delta_rule(k.shape[2], v.shape[2])
        if native is not None:
            writes = self.writes
            if q.shape[1] > 1:
                # Each real token's state goes to the row's own slot, so the kernel carries it
                # through a prefill chunk in place; a padding token (out of range) ends the row.
                writes = jnp.where(valid, writes[:, None], self.pool.shape[0])
            return native(self.pool, self.reads, writes, q, k, v, g, beta, valid)
        state = jnp.take(self.pool, self.reads, axis=0, mode="fill", fill_value=0)
        return GDNState(state, self.conv).advance(q, k, v, g, beta, valid)

    def convolve(
        self, x: jax.Array, weight: jax.Array, valid: jax.Array, source: Columns | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """y and the rows' new conv states, or with `conv_pool` the pool holding them (the
        native kernel reading x's channels from `source` where it is given)."""
        if self.conv_pool is None:
            return causal_conv(x, weight, self.conv, valid)
        native = dispatch.pooled_conv(self.conv_pool.dtype)
        if source is not None and source.array.dtype == x.dtype:
            x, native = source.array, functools.partial(native, columns=source.at)
        return native(self.conv_pool, self.reads, self.writes, x, weight, valid)


def updates_in_place(cfg: ModelConfig, kernels: str, mesh: Mesh) -> bool:
    """Whether a stage step updates its GDN pools itself (the native kernel runs) and so
    returns the pools rather than rows for `write_slots`."""
    with dispatch.kernels(kernels), head_parallel.across(mesh):
        native = dispatch.pooled_delta_rule(cfg.linear_num_key_heads, cfg.linear_num_value_heads)
    return native is not None


def conv_in_place(
    cfg: ModelConfig, kernels: str, mesh: Mesh, gdn: tuple[Any, ...], verify: bool
) -> bool:
    """Whether a stage step with GDN pools `gdn` (not a verify step, whose conv states go to a
    chain of slots) also takes its GDN convs in the slots of the conv pools and returns them."""
    if not gdn or verify:
        return False
    with dispatch.kernels(kernels), head_parallel.across(mesh):
        native = dispatch.pooled_conv(jnp.dtype(gdn[0].conv.dtype)) is not None
    return native and updates_in_place(cfg, kernels, mesh)


class Scores(NamedTuple):
    """Prompt logprobs of a scoring step: at each position, of the token that follows it."""

    chosen: jax.Array  # [B, T] f32, log p(targets[b, t] | tokens up to t)
    top_logprobs: jax.Array  # [B, T, k] f32
    top_ids: jax.Array  # [B, T, k] i32


def stage_step(
    cfg: ModelConfig,
    parts: ModelParts,
    span: StageSpan,
    kernels: str,
    score: int | None,
    mesh: Mesh,
    params: StageParams,
    kv: tuple[KVPages, ...],
    gdn: tuple[GDNSlots, ...],
    x: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    slot_ids: jax.Array,
    extra: jax.Array | None = None,
    *,
    verify: bool = False,
    hidden: bool = False,
) -> tuple[Any, tuple[KVPages, ...], Any]:
    """One stage of a step. x: tokens [B, T] (first stage) or hidden [B, T, hidden];
    positions: [B, T]; page_table: [B, M]; slot_ids: [B]; kv and gdn: this stage's pools.

    Returns the stage's output (hidden, or on the last stage float32 logits at each row's last
    real token, [B, vocab]), its updated KV pages, and each of its GDN layers' new per-row
    state ([B, ...]) for `write_slots`; where `updates_in_place`, its updated GDN pools (the
    `gdn` it was given, donated) and the rows' conv states instead: (pools, rows whose
    recurrent is None). `kernels` is the kernel dispatch mode it is traced in; the kernels run
    per device over its heads of the stage's `mesh` (see `kernels_pallas.head_parallel`).
    With `score` (a number of top alternatives) the last stage also returns the `Scores` of
    `extra`, the targets [B, T] (the token after each position): (logits, scores).

    A speculative engine's steps (`hidden`) pair the last stage's output with the final-normed
    hidden state at every position: (output, [B, T, hidden]). A `verify` step returns logits at
    every position and keeps the GDN state after each position t in slot `extra[b, t]` (the
    chain, `ChainedGDN`): its rows are states per position, [B, T, ...], for `write_chain`.
    """
    targets, chain = (None, extra) if verify else (extra, None)
    fresh = positions[:, 0] == 0
    native_conv = conv_in_place(cfg, kernels, mesh, gdn, verify)
    caches: list[Any] = []
    kv_iter, gdn_iter = iter(kv), iter(gdn)
    for i in span.layers:
        if cfg.layer_types[i] == FULL_ATTENTION:
            pages = next(kv_iter)
            caches.append(PagedKV(pages, page_table))
        else:
            slots = next(gdn_iter)
            # A fresh row reads no slot: one past the pool reads zeros.
            reads = jnp.where(fresh, slots.recurrent.shape[0], slot_ids)
            if native_conv:
                caches.append(PooledGDN(slots.recurrent, reads, slot_ids, None, slots.conv))
                continue
            conv = jnp.take(slots.conv, reads, axis=0, mode="fill", fill_value=0)
            if chain is not None:
                caches.append(ChainedGDN(slots.recurrent, reads, chain, conv))
            else:
                caches.append(PooledGDN(slots.recurrent, reads, slot_ids, conv))
    scoring = score is not None and span.last
    # A verify step's matmuls take the paths its decode step takes (`step_rows`).
    per_row = step_rows.positions_per_row(x.shape[1] if verify else 1)
    with dispatch.kernels(kernels), head_parallel.across(mesh), per_row:
        out, new_caches = stage_forward(
            parts,
            span,
            params,
            x,
            positions,
            tuple(caches),
            every_position=scoring or verify,
            hidden=hidden and span.last,
        )
    if scoring:
        logits, normed = out if hidden else (out, None)
        out = _scored(logits, positions, targets, score)
        out = (out, normed) if hidden else out
    new_kv, rows = [], []
    for i, new in zip(span.layers, new_caches, strict=True):
        if cfg.layer_types[i] == FULL_ATTENTION:
            new_kv.append(new.pages)
        else:
            rows.append(new)
    if native_conv:  # both pools updated in place: nothing left for `write_slots`
        pools = tuple(GDNSlots(r.recurrent, r.conv) for r in rows)
        return out, tuple(new_kv), (pools, tuple(GDNState(None, None) for _ in rows))
    if updates_in_place(cfg, kernels, mesh):
        # The conv pools pass through unchanged (donated, so not copied) for `write_slots`.
        pools = tuple(GDNSlots(r.recurrent, g.conv) for g, r in zip(gdn, rows, strict=True))
        return out, tuple(new_kv), (pools, tuple(GDNState(None, r.conv) for r in rows))
    return out, tuple(new_kv), tuple(rows)


def _scored(
    logits: jax.Array, positions: jax.Array, targets: jax.Array, k: int
) -> tuple[jax.Array, Scores]:
    """[B, T, V] logits -> the last real token's logits [B, V] and the log-softmax scores."""
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
    final = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    none = (logprobs[..., :0], jnp.zeros((*targets.shape, 0), jnp.int32))
    top_lp, top_ids = jax.lax.top_k(logprobs, k) if k else none
    return final, Scores(chosen, top_lp, top_ids.astype(jnp.int32))


def write_slots(
    gdn: tuple[GDNSlots, ...], slot_ids: jax.Array, rows: tuple[GDNState, ...]
) -> tuple[GDNSlots, ...]:
    """Write each row's new state into its slot; padding rows (out-of-range ids) are dropped.
    A row whose recurrent or conv state is None was updated in its slot already."""
    return tuple(
        GDNSlots(
            recurrent=slots.recurrent
            if row.recurrent is None
            else _write_rows(slots.recurrent, slot_ids, row.recurrent),
            conv=slots.conv if row.conv is None else _write_rows(slots.conv, slot_ids, row.conv),
        )
        for slots, row in zip(gdn, rows, strict=True)
    )


def write_chain(
    gdn: tuple[GDNSlots, ...], chain: jax.Array, rows: tuple[GDNState, ...]
) -> tuple[GDNSlots, ...]:
    """A verify step's `write_slots`: each position's state [B, T, ...] into its chain slot
    [B, T] (out of range: dropped)."""
    flat = tuple(
        GDNState(*(None if a is None else a.reshape(-1, *a.shape[2:]) for a in row)) for row in rows
    )
    return write_slots(gdn, chain.reshape(-1), flat)


def writing(kernels: str, mesh: Mesh | None, writer: Any, *args: Any) -> Any:
    """`writer(*args)` (`write_slots`, `write_chain`) traced for a stage's kernel mode and mesh."""
    with dispatch.kernels(kernels), head_parallel.across(mesh):
        return writer(*args)


def _write_rows(pool: jax.Array, slot_ids: jax.Array, rows: jax.Array) -> jax.Array:
    if head_parallel.local():
        # One device: in native mode the kernel writes the rows into the donated pool in place
        # (0.10 ms a layer at 32 rows, XLA's scatter 0.13, between one step and the next).
        return dispatch.page_writer()(pool, rows, slot_ids)
    return pool.at[slot_ids].set(rows.astype(pool.dtype), mode="drop")
