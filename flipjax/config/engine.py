"""What the engine itself is configured by: the model it loads, its pools and batching, its
prefix cache, and where its state lives.

Sizes are counts, not bytes, except where a field says so. Validation lives here, so a bad
option fails when the config is built, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flipjax.config.option import option
from flipjax.model.config import (
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ModelConfig,
    check_quantization,
)
from flipjax.runtime.buckets import PREFILL_ROWS_TOKENS
from flipjax.runtime.hybrid import check_interval, default_interval
from sharding.budgets import parse_size, parse_sizes


class GridStore(Protocol):
    """What the cache config asks of a prefix store: its page size and GDN grid."""

    page_size: int
    gdn_interval: int


@dataclass(frozen=True)
class ModelOptions:
    model: str = option(
        "tiny", "HF checkpoint folder, orbax folder, 'flipjax-py' (shipped), or 'tiny' (default)"
    )
    dtype: str = option("float32", "the weights' and activations' dtype", choices=DTYPE_NAMES)
    quantization: str | None = option(
        None,
        "quantize the weights at load: 'int8' keeps the projections, MLPs and experts in int8 "
        "with a scale per output channel (activations stay in --dtype)",
        choices=QUANTIZATIONS,
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: {self.dtype!r} is not supported; use one of {DTYPE_NAMES}")
        check_quantization(self.quantization)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine pools and batches."""

    page_size: int = option(16, "tokens per KV page")
    num_pages: int | None = option(
        None,
        "KV pages in the device pool (default: as many as the --device-memory budgets leave "
        "in every layout the engine starts with, else 1024; with budgets, a cap)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV pages' dtype: 'auto' (the model's), or 8 bits with a scale per page and KV "
        "head, 'fp8_e4m3' (alias 'fp8') or 'int8'; GDN states keep their own dtypes",
        choices=tuple(KV_CACHE_DTYPES),
    )
    max_running_requests: int = option(32, "requests decoding at once")
    num_slots: int | None = option(
        None,
        "GDN state slots (default: twice --max-running-requests); running requests hold one "
        "each, the device prefix cache keeps grid states in the rest",
    )
    max_prefill_tokens: int = option(2048, "prefill token budget per step")
    max_prefill_rows: int = option(
        4,
        "prompt chunks of one length bucket prefilled together in one call, a power of two "
        f"(calls of up to {PREFILL_ROWS_TOKENS} positions); 1 prefills each chunk alone",
    )
    max_model_len: int | None = option(None, "prompt + output cap (default: the model's context)")
    overlap: bool = option(
        True,
        "take each decode step's tokens in before dispatching the next (by default a steady "
        "decode batch runs one step ahead of the host; the tokens are the same)",
        flag="--disable-overlap-schedule",
        negate=True,
    )

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "num_pages",
            "max_running_requests",
            "max_prefill_tokens",
            "max_prefill_rows",
        ):
            value = getattr(self, name)
            if name == "num_pages" and value is None:
                continue
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_prefill_rows & (self.max_prefill_rows - 1):
            raise ValueError(
                f"max_prefill_rows: must be a power of two, got {self.max_prefill_rows}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not supported; use one of "
                f"{tuple(KV_CACHE_DTYPES)}"
            )
        if self.kv_cache_dtype == "fp8":  # one spelling, for whatever compares configs
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
        if self.num_slots is not None and self.num_slots < self.max_running_requests:
            raise ValueError(
                f"num_slots: {self.num_slots} is below max_running_requests "
                f"{self.max_running_requests}; every running request holds a slot"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")

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


@dataclass(frozen=True)
class CacheConfig:
    """The device prefix cache, and how prefixes are reused from the store."""

    prefix_cache: bool = option(
        True,
        "keep no finished requests' pages and grid states on the device for reuse",
        flag="--disable-radix-cache",
        negate=True,
    )
    gdn_checkpoint_interval: int | None = option(
        None,
        "tokens between cached GDN states, a multiple of the page size (default: the prefix "
        "store's, else the page multiple nearest at or above 256)",
    )
    # Running requests step on meanwhile: no step waits on the store.
    prefetch_wait_s: float = option(
        0.1,
        "how long a queued request may wait for its stored prefix to reach host memory "
        "before it computes (0: never; running requests step on meanwhile)",
        flag="--prefetch-wait-ms",
        unit=1e-3,
    )

    def __post_init__(self) -> None:
        if not 0 <= self.prefetch_wait_s < float("inf"):
            raise ValueError(f"prefetch_wait_s: must be 0 or more, got {self.prefetch_wait_s}")

    def gdn_interval(self, page_size: int, store: GridStore | None) -> int:
        """The GDN checkpoint grid: the configured one, else the prefix store's, else the
        default. A store with another page size, or another grid than the configured one, is
        refused."""
        configured = self.gdn_checkpoint_interval
        if configured is not None:
            check_interval(configured, page_size)
        if store is None:
            return configured if configured is not None else default_interval(page_size)
        if store.page_size != page_size:
            raise ValueError(
                f"prefix_store: page size {store.page_size} is not the engine's {page_size}"
            )
        if configured not in (None, store.gdn_interval):
            raise ValueError(
                f"gdn_checkpoint_interval: {configured} is not the prefix store's "
                f"{store.gdn_interval}"
            )
        return store.gdn_interval


@dataclass(frozen=True)
class LayoutConfig:
    """Where the state lives, which layouts are compiled ahead, and who flips."""

    layout: str | None = option(
        None,
        "where the state lives: single (default), tp, tp:N, pp:L1,L2,...[@W1,...], or auto "
        "(stages split in proportion to --device-memory, and the widest TP that fits armed)",
    )
    arm: tuple[str, ...] = option(
        (),
        "compile a layout's programs at start, so a flip to it compiles nothing (repeatable)",
        metavar="LAYOUT",
    )
    phase_policy: str = option(
        "manual",
        "auto: flip by measured throughput between --layout (the prefill layout) and the one "
        "--arm layout (the decode layout)",
        choices=("manual", "auto"),
    )
    ttft_budget_s: float | None = option(
        None,
        "auto policy: a ceiling on queued prompts' time to first token it respects when it "
        "weighs a flip",
    )
    flip_memory_headroom: int | None = option(
        None,
        "GiB a flip may add per device on devices without memory_stats (the CPU); a flip that "
        "needs more is refused",
        unit=2**30,
        metavar="GIB",
    )
    device_memory: str | None = option(
        None,
        "memory budget per device: one size for every device, or one per device in device "
        "order (e.g. 32GiB,10GiB,10GiB); the engine places no more on a device than its "
        "budget (default: on a GPU its memory limit x --mem-fraction-static; on the CPU none)",
        metavar="SIZE[,SIZE...]",
    )
    flip_window: str | None = option(
        None,
        "what a flip may hold on a device beyond the larger of the old and the new layout's "
        "footprint, e.g. 256MiB (default: a twentieth of the device's budget)",
        metavar="SIZE",
    )
    mem_fraction_static: float = option(
        0.88,
        "share of a GPU's memory limit the engine's budget takes when --device-memory is not given",
    )
    warmup: bool = option(
        True,
        "skip compiling every step shape at start (serving then compiles on first use of each "
        "shape)",
        flag="--no-warmup",
        negate=True,
    )

    def __post_init__(self) -> None:
        if self.device_memory is not None:
            parse_sizes(self.device_memory)  # BudgetError (a ValueError) naming the size
        if self.flip_window is not None:
            parse_size(self.flip_window)
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(
                f"mem_fraction_static: must be in (0, 1], got {self.mem_fraction_static}"
            )
        if self.phase_policy == "auto" and len(self.arm) != 1 and self.layout != "auto":
            raise ValueError(
                f"phase_policy: auto needs exactly one arm layout (--arm: the decode layout), "
                f"got {len(self.arm)}"
            )
