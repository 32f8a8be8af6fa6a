"""What the engine says about itself: `EngineInfo`, fixed at construction (the model, its
tokenizer, the context, the config), and `EngineStats`, a frozen snapshot taken between two
steps (queues, pools, prefix-cache and store counters, layout, flips, compiles).

Metrics, admin routes, the phase policy, the CLI and the benchmarks read these and nothing
else of the engine's insides; a snapshot shares nothing mutable with the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from flipjax.config.tree import FlipjaxConfig
from flipjax.engine.outputs import StepStats
from flipjax.model.config import ModelConfig
from flipjax.model.tokenizer import Tokenizer
from sharding.flip import FlipRecord


@dataclass(frozen=True)
class EngineInfo:
    name: str  # the model's name (its folder's, or "tiny")
    model: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output, at most
    config: FlipjaxConfig


@dataclass(frozen=True)
class SpeculativeStats:
    """Speculative decoding since start: verify rows, drafts checked and kept, how many tokens
    a row took per step (accept length: kept drafts + the model's own), and per draft
    position how many were checked and kept."""

    num_steps: int  # drafts per row (K)
    verify_rows: int
    drafted: int
    accepted: int
    accept_lengths: Mapping[int, int]  # tokens taken in one step -> rows
    drafted_at: tuple[int, ...]  # per draft position 1..K
    accepted_at: tuple[int, ...]
    plain_steps: int = 0  # decode steps the policy ran without drafts (it measured them faster)
    switches: int = 0  # times the policy changed way

    @property
    def mean_accept_length(self) -> float:
        rows = sum(self.accept_lengths.values())
        return sum(n * c for n, c in self.accept_lengths.items()) / rows if rows else 0.0


@dataclass(frozen=True)
class EngineStats:
    layout: str  # the current layout's text form: single, tp:2, pp:5,3, ...
    generation: int  # binding generation: one per flip
    armed: tuple[str, ...]  # layouts whose programs are compiled
    flips: tuple[FlipRecord, ...]  # every flip so far, oldest first
    devices: int  # devices the current layout spans
    running: int
    waiting: int
    queued_tokens: int  # prompt tokens still to prefill, waiting and running requests'
    decode_tokens_left: tuple[int, ...]  # per decoding request: tokens it may still generate
    awaiting_first_token: Mapping[str, float]  # request id -> arrival (perf_counter seconds)
    # pages_total, pages_free, pages_requests, pages_cache, and slots_* alike
    pools: Mapping[str, int]
    prefix: Mapping[str, int]  # admissions by where their prefix came from, hit tokens per tier
    # the scheduler's counters: admitted, prefetch_waits, and each relief-ladder step taken when
    # pages ran short (unforked, parked, throttled, evicted, retracted)
    scheduling: Mapping[str, int]
    faults: Mapping[str, int]  # requests failed by a fault in their own work, by stage
    store: Mapping[str, Mapping[str, int]]  # the KV store's counters by tier; {} without one
    prefix_cache_states: int  # GDN states the device prefix cache may keep (0: it is off)
    gdn_interval: int  # tokens between cached GDN states
    compiles: int  # step programs compiled by this engine
    last_step: StepStats | None
    speculative: SpeculativeStats | None = None  # None: the engine does not speculate


def frozen(counts: Mapping[str, int]) -> Mapping[str, int]:
    """A read-only copy: the snapshot must not change as the engine steps on."""
    return MappingProxyType(dict(counts))
