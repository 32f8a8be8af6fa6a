"""`EngineStats` taken from an engine's parts: what `Engine.stats` returns."""

from __future__ import annotations

from types import MappingProxyType

from flipjax.engine.assembly import Parts
from flipjax.engine.outputs import StepStats
from flipjax.engine.stats import EngineStats, frozen


def snapshot(p: Parts, layout: str, last_step: StepStats | None) -> EngineStats:
    """A frozen snapshot of `p`'s queues, pools, counters, layout and flips (between steps)."""
    pages, slots, store = p.allocator.pages, p.allocator.slots, p.prefix_store
    pools = {"pages_total": pages.total, "pages_free": pages.num_free}
    pools |= {"slots_total": slots.total, "slots_free": slots.num_free}
    cache, sched, spec = p.prefix_cache, p.scheduler, p.stepper.speculation
    everyone = (*sched.waiting, *sched.running)
    decoders = [s for s in sched.running if s.is_decoding]
    return EngineStats(
        layout=layout,
        generation=p.layouts.generation,
        armed=tuple(p.layouts.armed),
        flips=tuple(p.layouts.flips),
        devices=len(p.runner.binding.placement.devices),
        running=len(sched.running),
        waiting=len(sched.waiting),
        queued_tokens=sum(s.num_pending for s in everyone) - len(decoders),
        decode_tokens_left=tuple(s.max_tokens - len(s.output_ids) for s in decoders),
        awaiting_first_token=MappingProxyType(
            {s.request_id: s.arrival_time for s in everyone if len(s.output_ids) == s.carried}
        ),
        pools=frozen(pools | p.caches.usage()),
        prefix=frozen(p.reuse.counters),
        scheduling=frozen(sched.counters),
        faults=frozen(sched.faults.counters),
        store={t: frozen(c) for t, c in (store.stats() if store else {}).items()},
        prefix_cache_states=cache.max_states if cache is not None else 0,
        gdn_interval=p.gdn_interval,
        compiles=p.runner.compiles.count,
        last_step=last_step,
        speculative=spec.stats() if spec is not None else None,
    )
