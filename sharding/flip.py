"""The live phase flip: move the one logical state to another layout and swap the binding.

`Layouts.flip(layout)` checks the target (a `LayoutError` leaves everything as it was), makes
sure its step programs are compiled (`Layouts.arm`; a flip to an armed layout compiles
nothing), checks the target devices have room for it beside what they hold (a `FlipError`
names the numbers), then copies device to device, never through the host: the parameters
whole, and of the pools only the pages and slots someone holds (`sharding.movers`; the target
allocates the rest itself). It verifies every copy landed where the placement says, and only
then swaps `runner.binding`. Until the swap the old binding serves and owns every array, so a
failure at any point before it loses nothing. After the swap nothing refers to the old arrays,
so they are freed; they are not deleted by hand, because a shard that already sat where the
target wants it may be shared by the new array rather than copied.

Requests in flight need nothing: page and slot ids are logical, the scheduler's tables keep
their meaning, and the next step simply runs on the new binding. The copy is not donated: a
donated move that failed half way would leave neither layout whole. The price is that the
moved state is briefly held twice, which the room check accounts for.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from flipjax.runtime import cache_io
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.binding import Binding, compile_programs
from flipjax.runtime.cache import CacheState
from flipjax.runtime.crosshost import reshard
from flipjax.runtime.mirror import mirrored
from flipjax.runtime.model_runner import ModelRunner
from flipjax.runtime.placement import Placement
from sharding.layout import Layout, parse_layout, placement_for
from sharding.memory import bytes_per_device, held_bytes, shortfall
from sharding.movers import move_live, warm

log = logging.getLogger("flipjax.flip")


class FlipError(RuntimeError):
    """A flip failed or was refused before the swap; the old layout is still bound."""


@dataclass(frozen=True)
class FlipRecord:
    """What one flip moved and how long each part took."""

    source: str
    target: str
    generation: int  # the binding generation after this flip
    weights_bytes: int
    kv_bytes: int  # what crossed: the live pages, rounded up to a bucket
    gdn_bytes: int
    weights_ms: float
    kv_ms: float
    gdn_ms: float
    total_ms: float
    check_ms: float = 0.0  # room before, landing after
    held_bytes: int = 0  # the whole state: what moving the pools whole would have moved
    live_pages: int = 0
    live_slots: int = 0
    reseeded: int = 0  # cached-prefix pages dropped for the store to serve again

    @property
    def direction(self) -> str:
        return f"{self.source}->{self.target}"

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.gdn_bytes


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _move(tree: Any, shardings: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    moved = jax.block_until_ready(reshard(tree, shardings))
    return moved, (time.perf_counter() - t0) * 1e3


def _move_pools(
    state: CacheState, shardings: CacheState, pages: list[int], slots: list[int]
) -> tuple[CacheState, dict[str, float]]:
    return move_live(state, shardings, pages, slots)


def arm(runner: ModelRunner, placement: Placement, state_io: bool = False) -> None:
    """Compile everything a flip to `placement` and back would compile.

    That is the target's step programs for every serving shape, the transfer programs
    `jax.device_put` builds to reshard the parameters (warmed by a trial move there and back),
    and the live-set movers of the pools for every bucket of rows. Transfers are warmed between
    the current layout and the target only; arm from the layout you will flip from. With
    `state_io`, the programs that move pages and states (prefix cache and store) are warmed on
    a trial pool on the target too. The binding is not touched.
    """
    skeleton = runner.binding.rebind(placement, runner.binding.params, runner.binding.state)
    shapes = set(runner.shapes)
    for b, t in runner.shapes:  # the pieces a pipeline cuts steps into
        shapes.add(skeleton.split(b, t)[1:])
    with runner.compiles.watch():
        compile_programs(skeleton, sorted(shapes))
        current = runner.binding
        if placement.key != current.placement.key:
            (there_sh, target_sh), (back_sh, source_sh) = (
                _shardings(runner, placement),
                _shardings(runner, current.placement),
            )
            there = jax.block_until_ready(reshard(current.params, there_sh))
            jax.block_until_ready(reshard(there, back_sh))
            warm(current.state, source_sh, target_sh)
            if state_io:
                cache_io.warm(move_live(current.state, target_sh, [], [])[0], runner.table_width)


def _shardings(runner: ModelRunner, placement: Placement) -> tuple[Any, Any]:
    return (
        placement.param_shardings(runner.binding.params),
        placement.state_shardings(runner.cfg),
    )


def _check_landed(tree: Any, shardings: Any, what: str) -> None:
    for leaf, want in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            raise FlipError(f"flip: a {what} leaf landed on {leaf.sharding}, not {want}")


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
    ):
        self.runner = runner
        self.allocator = allocator
        self.state_io = state_io  # also warm the page and state moves of the prefix cache/store
        self.headroom = headroom
        self.budgets = budgets  # per device id: a flip's need is held within them
        self.armed: dict[str, Placement] = {runner.binding.placement.name: runner.binding.placement}
        self.generation = 0
        self.flips: list[FlipRecord] = []
        self.counters: Counter[str] = Counter()  # flips, refused_memory, failed

    @property
    def current(self) -> str:
        return self.runner.binding.placement.name

    def arm(self, layout: str | Layout) -> Placement:
        """Check `layout` (`LayoutError` when the model or the devices cannot take it) and
        compile everything a flip to it and back needs; the binding is not touched."""
        placement_for(layout, self.runner.cfg)  # refused here, before any process starts it
        return self.prepare(str(parse_layout(layout)), self.state_io)

    @mirrored
    def prepare(self, layout: str, state_io: bool) -> Placement:
        """`arm` (every process of a cluster runs it alike: `state_io` is explicit)."""
        placement = placement_for(layout, self.runner.cfg)
        arm(self.runner, placement, state_io)
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
        param_sh, state_sh = _shardings(runner, placement)
        need = bytes_per_device((old.params, old.state), (param_sh, state_sh))
        held = held_bytes((old.params, old.state)) if self.budgets else None
        if (why := shortfall(need, self.headroom, self.budgets, held)) is not None:
            self.counters["refused_memory"] += 1
            raise FlipError(f"flip to {placement.name} refused: {why}")
        dropped = reseed() if reseed is not None else 0
        pages, slots = self.allocator.held_pages(), self.allocator.held_slots()
        check_ms = (time.perf_counter() - t0) * 1e3
        try:
            moved = self.move(placement.name, pages, slots)
        except FlipError:
            self.counters["failed"] += 1
            raise
        except Exception as err:  # noqa: BLE001 - any failure here must leave the old layout bound
            self.counters["failed"] += 1
            raise FlipError(f"flip to {placement.name} failed before the swap: {err}") from err
        self.generation += 1
        self.counters["flips"] += 1
        record = FlipRecord(
            source=old.placement.name,
            target=placement.name,
            generation=self.generation,
            total_ms=(time.perf_counter() - t0) * 1e3,
            held_bytes=_nbytes((old.params, old.state)),
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

    @mirrored
    def move(self, layout: str, pages: list[int], slots: list[int]) -> dict[str, Any]:
        """Copy the parameters and the live `pages` and `slots` to the armed `layout` and swap
        the binding; what was moved. The old binding stays whole until the swap."""
        runner, placement = self.runner, self.armed[layout]
        param_sh, state_sh = _shardings(runner, placement)
        with runner.compiles.watch():  # a compile here would be on the critical path
            new, moved = _placed_copy(runner.binding, placement, param_sh, state_sh, pages, slots)
        runner.binding = new  # the swap: from here on every reader sees the new layout
        return moved


def _placed_copy(
    old: Binding,
    placement: Placement,
    param_sh: Any,
    state_sh: CacheState,
    pages: list[int],
    slots: list[int],
) -> tuple[Binding, dict[str, Any]]:
    """Copy the parameters and the live pools to `placement`, check where each landed, and
    bind the copies. Returns the new binding and what was moved (bytes and ms per part)."""
    params, weights_ms = _move(old.params, param_sh)
    state, pools = _move_pools(old.state, state_sh, pages, slots)
    t0 = time.perf_counter()
    _check_landed(params, param_sh, "weight")
    _check_landed(state, state_sh, "pool")
    moved = dict(
        weights_bytes=_nbytes(params),
        weights_ms=weights_ms,
        **pools,
        check_ms=(time.perf_counter() - t0) * 1e3,
    )
    return old.rebind(placement, params, state), moved
