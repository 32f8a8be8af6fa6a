"""EngineConfig: how the engine pools and batches, passed explicitly to the parts that need it.

Sizes are counts, not bytes. Validation lives here, so a bad option fails when the engine is
built, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from flipjax.model.config import ModelConfig
from flipjax.runtime.hybrid import check_interval, default_interval
from store.prefix import PrefixStore


@dataclass(frozen=True)
class EngineConfig:
    """How the engine pools and batches. Sizes are counts, not bytes."""

    page_size: int = 16
    num_pages: int = 1024
    max_running_requests: int = 32
    # GDN state slots; by default twice max_running_requests. Running requests hold one each;
    # the device prefix cache keeps grid states in the rest.
    num_slots: int | None = None
    max_prefill_tokens: int = 2048  # prefill token budget per step
    max_model_len: int | None = None  # prompt + output cap; default the model's context
    # Tokens between cached GDN states, the points a prefix can be reused from; by default the
    # prefix store's interval, or `hybrid.default_interval` without one.
    gdn_checkpoint_interval: int | None = None
    prefix_cache: bool = True  # keep finished requests' pages and grid states for reuse
    # Bytes a flip may add per device on devices that report no memory_stats (None: unchecked).
    flip_memory_headroom: int | None = None
    # How long the queue's head may wait for its stored prefix to reach host memory before it
    # is admitted and computes (catching up if the prefix lands mid-prefill); 0: never waits.
    # Running requests step on meanwhile: no step waits on the store.
    prefetch_wait_s: float = 0.1
    # Dispatch a steady decode batch's next step before its sampled ids reach the host
    # (`flipjax.engine.overlap`); the tokens are the same either way.
    overlap: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_running_requests", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_slots is not None and self.num_slots < self.max_running_requests:
            raise ValueError(
                f"num_slots: {self.num_slots} is below max_running_requests "
                f"{self.max_running_requests}; every running request holds a slot"
            )

        if not 0 <= self.prefetch_wait_s < float("inf"):
            raise ValueError(f"prefetch_wait_s: must be 0 or more, got {self.prefetch_wait_s}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")
        if self.gdn_checkpoint_interval is not None:
            check_interval(self.gdn_checkpoint_interval, self.page_size)

    @property
    def slots(self) -> int:
        return self.num_slots if self.num_slots is not None else 2 * self.max_running_requests

    def model_len(self, cfg: ModelConfig) -> int:
        """The context this engine serves: max_model_len, capped by the model's own."""
        limit = cfg.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's context {limit}"
            )
        return self.max_model_len or limit

    def gdn_interval(self, store: PrefixStore | None) -> int:
        """The GDN checkpoint grid: the configured one, else the prefix store's, else the
        default. A store with another page size, or another grid than the configured one, is
        refused."""
        configured = self.gdn_checkpoint_interval
        if store is None:
            return configured if configured is not None else default_interval(self.page_size)
        if store.page_size != self.page_size:
            raise ValueError(
                f"prefix_store: page size {store.page_size} is not the engine's {self.page_size}"
            )
        if configured not in (None, store.gdn_interval):
            raise ValueError(
                f"gdn_checkpoint_interval: {configured} is not the prefix store's "
                f"{store.gdn_interval}"
            )
        return store.gdn_interval
