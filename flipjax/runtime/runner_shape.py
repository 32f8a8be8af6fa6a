"""What fixes a runner's pools and step shapes, derived by the engine from its config."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from flipjax.model.config import ModelConfig
from flipjax.runtime.buckets import MIN_PREFILL_BUCKET, pow2_range, prefill_rows
from flipjax.runtime.cache import CacheState, init_cache_state


@dataclass(frozen=True)
class RunnerShape:
    """What fixes the runner's pools and step shapes (the engine derives it from its config)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    page_size: int
    num_pages: int
    num_slots: int
    max_model_len: int
    max_running_requests: int
    max_prefill_tokens: int
    kv_dtype: jnp.dtype | None = None  # the KV pages' (`cache.kv_page_dtype`); None: `dtype`
    speculative_tokens: int = 0  # drafts a verify step checks per row (K); 0: no speculation
    max_prefill_rows: int = 1  # chunks of one prefill call (`buckets.prefill_rows`)

    def pools(self, num_pages: int | None = None) -> CacheState:
        """The shapes of the pools (with `num_pages` pages, default the shape's own)."""
        pages = self.num_pages if num_pages is None else num_pages
        return jax.eval_shape(
            lambda: init_cache_state(
                self.cfg, pages, self.page_size, self.num_slots, self.dtype, self.kv_dtype
            )
        )

    def prefill_rows(self) -> dict[int, int]:
        """Each prefill bucket (a power of two up to max_prefill_tokens) with the most chunks
        one call of it takes: no more than can run at once, and one in a speculating engine
        (its head drafts per prefill shape, so every shape would be one more to compile)."""
        most = (
            1 if self.speculative_tokens else min(self.max_prefill_rows, self.max_running_requests)
        )
        buckets = pow2_range(MIN_PREFILL_BUCKET, self.max_prefill_tokens)
        return {t: prefill_rows(t, most, self.max_prefill_tokens) for t in buckets}
