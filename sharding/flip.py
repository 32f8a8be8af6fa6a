"""The live phase flip: move the one logical state to another layout and swap the binding.

`Layouts.flip(layout)` checks the target (a `LayoutError` leaves everything as it was), makes
sure its programs are compiled (`Layouts.arm`; a flip to an armed layout compiles nothing),
checks the devices have room for it (a `FlipError` names the device, the need and the budget),
then moves the parameters and, of the pools, only the pages and slots someone holds.

In one process the move is windowed (`sharding.windowed_flip`): the live rows go to the host,
the old layout is freed, and the new one is written from the weights' host image and those
rows, so no device ever holds both layouts; a failure once the old layout is freed lands the
old layout again from the same host copies. Across processes (the weights have no host image
there) it copies device to device (`sharding.flip_copy`) and the old binding serves and owns
every array until the swap, so the moved state is briefly held twice.

Either way every leaf is checked to have landed where the placement says before
`runner.binding` is swapped, and a failure ends with one whole layout bound. Page and slot ids
are logical: the scheduler's tables keep their meaning, and the next step simply runs on the
new binding.

A windowed flip may also change the pool's size, each layout having the pages its devices
hold (`sharding.flip_pools`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from flipjax.runtime import multihost
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.cache import CacheState, resized
from flipjax.runtime.mirror import mirrored
from flipjax.runtime.model_runner import ModelRunner
from flipjax.runtime.placement import Placement
from flipjax.runtime.workspace_probe import workspace
from sharding import windowed_flip
from sharding.flip_copy import (
    FlipError,
    FlipRecord,
    arm,
    landed_ms,
    nbytes,
    placed_copy,
    shardings_of,
)
from sharding.flip_pools import FlipPools
from sharding.flip_waves import OnWave
from sharding.layout import Layout, parse_layout, placement_for
from sharding.memory import bytes_by_id, bytes_per_device, held_bytes, shortfall

__all__ = ["FlipError", "FlipRecord", "Layouts", "arm"]

log = logging.getLogger("flipjax.flip")


class Layouts:
    """The layouts a runner can take, and the flips between them: the placements armed so far,
    the binding generation (one per flip) and the record of every flip. It is the one writer
    of `runner.binding` after the engine is built; `allocator` says which pages and slots are
    held (they move), and `headroom` is the per-device budget on devices without
    `memory_stats`."""

    def __init__(
        self,
        runner: ModelRunner,
        allocator: Allocator,
        state_io: bool = False,
        headroom: int | None = None,
        budgets: dict[int, int] | None = None,
        flip_window: int | None = None,
        pool_pages: Callable[[Placement], int] | None = None,
    ):
        self.runner = runner
        # Each layout's pool size (`pool_pages`, from the budgets) and the engine's part in a
        # flip between sizes. Only a windowed flip resizes: a cluster's copy keeps one size.
        self.pools = FlipPools(allocator, pool_pages)
        self.flip_window = flip_window  # bytes per device; None: `windowed_flip.windows`
        # Called at every wave of a windowed flip with each device's program temp bytes: the
        # bench and the tests read live bytes there (and a test injects a failure).
        self.on_wave: OnWave | None = None
        # Copy device to device even in one process, both layouts held at once: a cluster's
        # flip, which the bench times the windowed one against.
        self.device_copy = False
        self.allocator = allocator
        self.state_io = state_io  # also warm the page and state moves of the prefix cache/store
        self.headroom = headroom
        self.budgets = budgets  # per device id: a flip's need is held within them
        self.armed: dict[str, Placement] = {runner.binding.placement.name: runner.binding.placement}
        self.generation = 0
        self.flips: list[FlipRecord] = []
        # flips, refused_memory, refused_pool, failed
        self.counters: Counter[str] = Counter()

    @property
    def current(self) -> str:
        return self.runner.binding.placement.name

    def arm(self, layout: str | Layout) -> Placement:
        """Check `layout` (`LayoutError` when the model or the devices cannot take it) and
        compile everything a flip to it and back needs; the binding is not touched."""
        placement_for(layout, self.runner.cfg)  # refused here, before any process starts it
        return self.prepare(str(parse_layout(layout)), self.state_io)

    @property
    def windowed(self) -> bool:
        """Whether flips pass through the host within a window (`sharding.windowed_flip`): in
        one process, with the weights' host image. A cluster copies device to device."""
        if self.device_copy:
            return False
        return self.runner.image is not None and not multihost.current().multi

    def pages_for(self, placement: Placement) -> int:
        """The pool's size in pages once in `placement`."""
        return self.pools.pages_for(placement, self.runner.binding.placement, self.windowed)

    def _pools(self, placement: Placement) -> CacheState | None:
        """The pools' shapes in `placement` when their size changes there, else None."""
        return resized(self.runner.binding.state, self.pages_for(placement))

    def _footprints(self, placement: Placement) -> tuple[Any, Any]:
        """(now, in `placement`): what each device (by id) holds of weights and pools."""
        old = self.runner.binding
        trees = (old.params, old.state)
        there = (old.params, self._pools(placement) or old.state)
        return held_bytes(trees), bytes_by_id(there, shardings_of(self.runner, placement))

    def window(self, placement: Placement) -> dict[int, int]:
        now, then = self._footprints(placement)
        return windowed_flip.windows(now, then, self.budgets, self.flip_window)

    @mirrored
    def prepare(self, layout: str, state_io: bool) -> Placement:
        """`arm` (every process of a cluster runs it alike: `state_io` is explicit)."""
        placement = placement_for(layout, self.runner.cfg)
        window = self.window(placement) if self.windowed else None
        arm(self.runner, placement, state_io, window, self._pools(placement))
        self.armed[placement.name] = placement
        return placement

    def flip(
        self, layout: str | Layout, reseed: Callable[[], int] | None = None
    ) -> FlipRecord | None:
        """Move the runner's state to `layout`; None when it is already there. `reseed`, when
        given, drops cached prefixes once the flip is known to have room (returns the pages it
        freed), so they are not moved: the store serves them again."""
        runner = self.runner
        old = runner.binding
        placement = self.armed.get(str(parse_layout(layout))) or self.arm(layout)
        if placement.key == old.placement.key:
            return None
        t0 = time.perf_counter()
        if (why := self._shortfall(placement)) is not None:
            self.counters["refused_memory"] += 1
            raise FlipError(f"flip to {placement.name} refused: {why}")
        total = self.pages_for(placement)
        if (why := self.pools.refusal(total)) is not None:
            self.counters["refused_pool"] += 1
            raise FlipError(f"flip to {placement.name} refused: {why}")
        dropped = reseed() if reseed is not None else 0
        self.pools.shrink_to(total)
        pages, slots = self.allocator.held_pages(), self.allocator.held_slots()
        check_ms = (time.perf_counter() - t0) * 1e3
        try:
            renumbered = self.allocator.pages.renumbering(total)
            moved = self.move(placement.name, pages, slots, total, renumbered)
        except FlipError:
            self.counters["failed"] += 1
            raise
        except Exception as err:  # noqa: BLE001 - any failure here must leave the old layout bound
            self.counters["failed"] += 1
            raise FlipError(f"flip to {placement.name} failed before the swap: {err}") from err
        self.pools.landed(old.placement.name, total, renumbered)
        self.generation += 1
        self.counters["flips"] += 1
        record = FlipRecord(
            source=old.placement.name,
            target=placement.name,
            generation=self.generation,
            total_ms=(time.perf_counter() - t0) * 1e3,
            held_bytes=nbytes((old.params, old.state)),
            live_pages=len(pages),
            live_slots=len(slots),
            reseeded=dropped,
            **{**moved, "check_ms": check_ms + moved["check_ms"]},
        )
        self.flips.append(record)
        log.info(
            "flip %s: %.1f ms | weights %.1f ms, KV %.1f ms (%d pages), GDN %.1f ms (%d slots), "
            "checks %.1f ms | moved %.1f of %.1f MiB held",
            record.direction,
            record.total_ms,
            record.weights_ms,
            record.kv_ms,
            len(pages),
            record.gdn_ms,
            len(slots),
            record.check_ms,
            record.total_bytes / 2**20,
            record.held_bytes / 2**20,
        )
        return record

    def _shortfall(self, placement: Placement) -> str | None:
        """Why a flip to `placement` does not fit, naming device, need and budget."""
        old = self.runner.binding
        if self.windowed:
            now, then = self._footprints(placement)
            window = windowed_flip.windows(now, then, self.budgets, self.flip_window)
            pools = self._pools(placement)
            skeleton = old if pools is None else old.rebind(placement, old.params, pools)
            work = workspace(skeleton, placement) if self.budgets else Counter()
            return windowed_flip.shortfall(
                placement.name, now, then, window, work, self.budgets, self.headroom
            )
        trees = (old.params, old.state)
        need = bytes_per_device(trees, shardings_of(self.runner, placement))
        held = held_bytes(trees) if self.budgets else None
        return shortfall(need, self.headroom, self.budgets, held)

    @mirrored
    def move(
        self,
        layout: str,
        pages: list[int],
        slots: list[int],
        total: int | None = None,
        renumbered: dict[int, int] | None = None,
    ) -> dict[str, Any]:
        """Move the parameters and the live `pages` and `slots` to the armed `layout` and swap
        the binding; what was moved. The pool there has `total` pages (default: as now), a
        live page landing where `renumbered` says. A failure ends with the old layout bound
        and whole."""
        runner, placement = self.runner, self.armed[layout]
        pools = None if total is None else resized(runner.binding.state, total)
        param_sh, state_sh = shardings_of(runner, placement)
        old = runner.binding
        with runner.compiles.watch():  # a compile here would be on the critical path
            if not self.windowed:
                if pools is not None:
                    raise FlipError(f"flip to {layout}: a cluster's flip keeps the pool's size")
                new, moved = placed_copy(old, placement, param_sh, state_sh, pages, slots)
            else:
                window = self.window(placement)
                try:
                    new, moved = windowed_flip.windowed_copy(
                        old,
                        placement,
                        param_sh,
                        state_sh,
                        runner.image,
                        pages,
                        slots,
                        window,
                        lambda params, state: landed_ms(params, param_sh, state, state_sh),
                        self.on_wave,
                        pools,
                        renumbered,
                    )
                except windowed_flip.Restored as restored:
                    runner.binding = restored.binding
                    raise FlipError(
                        f"flip to {layout} failed after the old layout was freed, and the old "
                        f"layout was restored from the host: {restored.cause}"
                    ) from restored.cause
        runner.binding = new  # the swap: from here on every reader sees the new layout
        return moved
