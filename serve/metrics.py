"""Prometheus metrics, names prefixed `flipjax:`. One registry per app.

Request metrics are recorded as requests finish; engine state (queues, pools, layout, flips)
is read at scrape time on the engine loop thread, so a scrape sees one consistent step
boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flipjax.config.speculative import MAX_NUM_STEPS
from flipjax.engine.engine import Output
from flipjax.engine.faults import STAGES as FAULT_STAGES
from flipjax.engine.stats import EngineStats, SpeculativeStats
from sharding.ledger import MemoryReport

TIERS = ("device", "host", "disk", "remote")
RELIEF_STEPS = ("evicted", "throttled", "retracted", "parked")
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("flipjax:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("flipjax:num_requests_waiting", "Requests waiting", registry=r)
        self.prompt_tokens = Counter("flipjax:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "flipjax:generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "flipjax:time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "flipjax:inter_token_latency_seconds",
            "Mean time between output tokens",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "flipjax:e2e_request_latency_seconds",
            "End-to-end latency",
            buckets=_LATENCY,
            registry=r,
        )
        self.finished = Counter(
            "flipjax:request_success", "Finished requests", ["finish_reason"], registry=r
        )
        self.kv_pages = Gauge("flipjax:kv_pages_used", "KV pages requests hold", registry=r)
        self.gdn_slots = Gauge("flipjax:gdn_slots_used", "GDN slots requests hold", registry=r)
        self.cache_pages = Gauge(
            "flipjax:prefix_cache_pages", "KV pages only the device prefix cache holds", registry=r
        )
        self.cache_states = Gauge(
            "flipjax:prefix_cache_states", "GDN states the device prefix cache holds", registry=r
        )
        self.prefix_hits = Counter(
            "flipjax:prefix_hits",
            "Admissions that reused a cached prefix, by tier",
            ["tier"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "flipjax:prefix_hit_tokens",
            "Prompt tokens reused instead of computed, by tier",
            ["tier"],
            registry=r,
        )
        self.prefix_misses = Counter(
            "flipjax:prefix_misses", "Admissions with no reusable prefix", registry=r
        )
        self.relief = Counter(
            "flipjax:relief_steps",
            "Relief-ladder steps taken when pages ran short",
            ["step"],
            registry=r,
        )
        self.faults = Counter(
            "flipjax:request_faults",
            "Requests failed by a fault in their own work (the others went on), by stage",
            ["stage"],
            registry=r,
        )
        self.store = Counter(
            "flipjax:store_events",
            "KV store counters, by tier and event",
            ["tier", "event"],
            registry=r,
        )
        self.store_up = Gauge(
            "flipjax:store_tier_available",
            "Whether a store tier answers (the remote one can be "
            "down: its calls are skipped until a backoff passes)",
            ["tier"],
            registry=r,
        )
        self.flips = Counter("flipjax:flips", "Layout flips", ["direction"], registry=r)
        self.flip_seconds = Counter("flipjax:flip_seconds", "Time spent flipping", registry=r)
        self.flip_parts = Histogram(
            "flipjax:flip_part_seconds",
            "Each part of a flip, per direction",
            ["direction", "part"],
            buckets=_LATENCY,
            registry=r,
        )
        self.flip_moved = Counter(
            "flipjax:flip_bytes",
            "Bytes flips moved, and the bytes they held",
            ["kind"],
            registry=r,
        )
        self.layout = Gauge("flipjax:layout", "The current layout (1)", ["layout"], registry=r)
        self.unknown_fields = Counter(
            "flipjax:unknown_request_fields",
            "Requests that sent a field flipjax ignores",
            ["field"],
            registry=r,
        )
        self.grammars = Counter(
            "flipjax:structured_output_grammars",
            "Structured-output grammars by outcome",
            ["event"],
            registry=r,
        )
        # Named as Prometheus exporters name byte gauges (`_bytes`), as operators look for it.
        self.device_memory = Gauge(
            "flipjax_device_memory_bytes",
            "Bytes the engine holds on each device of the live layout, by kind (weights, "
            "kv_pages, gdn_slots, workspace, reserve), and each device's budget",
            ["device", "kind"],
            registry=r,
        )
        self._speculation()
        self._flips_seen = 0
        self._totals: dict[int, int] = {}
        self._accept_lengths: dict[int, int] = {}

    def _speculation(self) -> None:
        """Speculative decoding's counters, named as vLLM names its own (`spec_decode_*`)."""
        r = self.registry
        self.spec_rows = Counter(
            "flipjax:spec_decode_num_drafts",
            "Verify-step rows (one per request per step)",
            registry=r,
        )
        self.spec_drafted = Counter(
            "flipjax:spec_decode_num_draft_tokens", "Draft tokens checked", registry=r
        )
        self.spec_accepted = Counter(
            "flipjax:spec_decode_num_accepted_tokens",
            "Draft tokens the model agreed with",
            registry=r,
        )
        self.spec_drafted_at = Counter(
            "flipjax:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens checked, by draft position (1 = the first after the pending token)",
            ["position"],
            registry=r,
        )
        self.spec_accepted_at = Counter(
            "flipjax:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept, by draft position",
            ["position"],
            registry=r,
        )
        self.spec_plain_steps = Counter(
            "flipjax:spec_decode_plain_steps",
            "Decode steps run without drafts, where this machine measured them faster",
            registry=r,
        )
        self.spec_accept_length = Histogram(
            "flipjax:spec_decode_accept_length",
            "Tokens a request took in one verify step (drafts kept + the model's own)",
            buckets=tuple(range(1, MAX_NUM_STEPS + 2)),
            registry=r,
        )

    def request_finished(self, out: Output) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.finished.labels(out.finish_reason).inc()
        self.e2e.observe(out.e2e_s)
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
            if len(out.token_ids) > 1:
                self.itl.observe((out.e2e_s - out.ttft_s) / (len(out.token_ids) - 1))

    def read_engine(self, stats: EngineStats) -> None:
        """Refresh the engine-state metrics from a snapshot taken between two steps."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_pages.set(stats.pools["pages_requests"])
        self.gdn_slots.set(stats.pools["slots_requests"])
        self.cache_pages.set(stats.pools["pages_cache"])
        self.cache_states.set(stats.pools["slots_cache"])
        prefix = stats.prefix
        for tier in TIERS:
            self._advance(self.prefix_hits.labels(tier), prefix.get(f"hits_{tier}", 0))
            tokens = prefix.get(f"hit_tokens_{tier}", 0)
            self._advance(self.prefix_hit_tokens.labels(tier), tokens)
        self._advance(self.prefix_misses, prefix.get("misses", 0))
        for step in RELIEF_STEPS:
            self._advance(self.relief.labels(step), stats.scheduling.get(step, 0))
        for stage in FAULT_STAGES:
            self._advance(self.faults.labels(stage), stats.faults.get(stage, 0))
        for tier, counters in stats.store.items():
            for event, total in counters.items():
                if event == "available":
                    self.store_up.labels(tier).set(total)
                else:
                    self._advance(self.store.labels(tier, event), total)
        for record in stats.flips[self._flips_seen :]:
            self.flips.labels(record.direction).inc()
            self.flip_seconds.inc(record.total_ms / 1e3)
            for part in ("weights", "kv", "gdn", "check", "total"):
                seconds = getattr(record, f"{part}_ms") / 1e3
                self.flip_parts.labels(record.direction, part).observe(seconds)
            self.flip_moved.labels("moved").inc(record.total_bytes)
            self.flip_moved.labels("held").inc(record.held_bytes)
        self._flips_seen = len(stats.flips)
        self.layout.clear()
        self.layout.labels(stats.layout).set(1)
        if stats.speculative is not None:
            self._read_speculative(stats.speculative)

    def _read_speculative(self, spec: SpeculativeStats) -> None:
        self._advance(self.spec_rows, spec.verify_rows)
        self._advance(self.spec_drafted, spec.drafted)
        self._advance(self.spec_accepted, spec.accepted)
        self._advance(self.spec_plain_steps, spec.plain_steps)
        for i, (drafted, accepted) in enumerate(
            zip(spec.drafted_at, spec.accepted_at, strict=True)
        ):
            self._advance(self.spec_drafted_at.labels(str(i + 1)), drafted)
            self._advance(self.spec_accepted_at.labels(str(i + 1)), accepted)
        for length, rows in spec.accept_lengths.items():
            seen = self._accept_lengths.get(length, 0)
            for _ in range(rows - seen):  # a histogram takes observations, not totals
                self.spec_accept_length.observe(length)
            self._accept_lengths[length] = max(seen, rows)

    def read_memory(self, memory: MemoryReport) -> None:
        """Refresh the ledger's gauges (a flip changes the devices: the old ones are dropped)."""
        self.device_memory.clear()
        for line in memory.devices:
            for kind, size in line.bytes.items():
                self.device_memory.labels(str(line.device), kind).set(size)
            if line.budget is not None:
                self.device_memory.labels(str(line.device), "budget").set(line.budget)

    def read_server(self, unknown: Mapping[str, int], grammars: Mapping[str, int]) -> None:
        """Refresh the counters the HTTP layer keeps: ignored fields, grammar compiles."""
        for name, total in unknown.items():
            self._advance(self.unknown_fields.labels(name), total)
        for event in ("compiled", "hits", "shared", "refused", "too_large", "busy", "timed_out"):
            self._advance(self.grammars.labels(event), grammars.get(event, 0))

    def _advance(self, counter: Any, total: int) -> None:
        """Bring a Prometheus counter up to an engine-side running total."""
        seen = self._totals.get(id(counter), 0)
        if total > seen:
            counter.inc(total - seen)
        self._totals[id(counter)] = max(seen, total)

    def render(self) -> Any:
        return generate_latest(self.registry)
