"""A speculative drafter's memory in the pools' and the ledger's terms: the MTP head's weights
and its copies of the embedding and the lm head, and its KV per page of the pool, on the
sampler's device (`flipjax.runtime.drafter`). Pool sizing counts it beside every layout, so a
budget that holds the model's pools holds the drafter's too, and the ledger shows it."""

from __future__ import annotations

from collections import Counter

import jax
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.mtp import Qwen3NextMTP
from flipjax.runtime.drafter import Drafter, drafter_bytes
from sharding.memory import held_bytes
from sharding.pool_sizing import Footprint


def drafter_footprint(
    cfg: ModelConfig,
    head: Qwen3NextMTP | None,
    params: nnx.State,
    page_size: int,
    quantization: str | None = None,
) -> Footprint | None:
    """What a drafter of `head` (its lm head `quantization`'s) will hold, before it is built
    (None: no drafter)."""
    if head is None:
        return None
    held = drafter_bytes(cfg, head, params, page_size, quantization)
    return _footprint(jax.devices()[0].id, *held)


def drafter_ledger(drafter: Drafter) -> tuple[Counter[int], Footprint]:
    """What `drafter` holds now (bytes by device id), and its footprint."""
    return held_bytes(drafter.held()), _footprint(drafter.device.id, *drafter.bytes)


def _footprint(device: int, weights: int, page: int) -> Footprint:
    return Footprint(Counter({device: weights}), Counter({device: page}), {})
