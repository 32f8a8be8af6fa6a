"""The engine's model step over pooled state: paged KV for attention, slots for GDN state.

`model_step` is pure over (params, CacheState) and is what gets jitted, placed and, later,
flipped between layouts. Rows are requests; a row's tokens continue its cached prefix (a
decode row has one token, a prefill row a chunk). A row whose first position is 0 starts from a
zero GDN state, so a recycled slot never leaks its previous owner's state. Padding rows carry
slot id `num_slots` and position -1: their reads are zeros and their writes are dropped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.cache import CacheState, GDNSlots, KVPages
from flipjax.config import FULL_ATTENTION, ModelConfig
from flipjax.gdn import GDNState
from flipjax.model import forward
from kernels_pallas.paged_attention import paged_attention_reference, write_pages


class PagedKV(NamedTuple):
    """Attention cache for one layer: its pages and the batch's page tables [B, max_pages]."""

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array

    def update_and_attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, PagedKV]:
        k_pages, v_pages = write_pages(self.k_pages, self.v_pages, k, v, self.page_table, positions)
        out = paged_attention_reference(q, k_pages, v_pages, self.page_table, positions)
        return out, PagedKV(k_pages, v_pages, self.page_table)


def model_step(
    cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: CacheState,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    slot_ids: jax.Array,
) -> tuple[jax.Array, CacheState]:
    """tokens, positions: [B, T]; page_table: [B, M]; slot_ids: [B].

    Returns logits at each row's last real token, [B, vocab] float32, and the new state.
    """
    fresh = (positions[:, 0] == 0)[:, None, None, None]
    caches: list[Any] = []
    kv_iter, gdn_iter = iter(state.kv), iter(state.gdn)
    for layer_type in cfg.layer_types:
        if layer_type == FULL_ATTENTION:
            pages = next(kv_iter)
            caches.append(PagedKV(pages.k, pages.v, page_table))
        else:
            slots = next(gdn_iter)
            rec = jnp.take(slots.recurrent, slot_ids, axis=0, mode="fill", fill_value=0)
            conv = jnp.take(slots.conv, slot_ids, axis=0, mode="fill", fill_value=0)
            caches.append(
                GDNState(
                    recurrent=jnp.where(fresh, 0.0, rec),
                    conv=jnp.where(fresh[..., 0], jnp.zeros_like(conv), conv),
                )
            )
    logits, new_caches = forward(graphdef, params, tokens, positions, tuple(caches), True)

    kv, gdn = [], []
    gdn_old = iter(state.gdn)
    for layer_type, new in zip(cfg.layer_types, new_caches, strict=True):
        if layer_type == FULL_ATTENTION:
            kv.append(KVPages(new.k_pages, new.v_pages))
        else:
            slots = next(gdn_old)
            gdn.append(
                GDNSlots(
                    recurrent=slots.recurrent.at[slot_ids].set(new.recurrent, mode="drop"),
                    conv=slots.conv.at[slot_ids].set(
                        new.conv.astype(slots.conv.dtype), mode="drop"
                    ),
                )
            )
    return logits, CacheState(kv=tuple(kv), gdn=tuple(gdn))
