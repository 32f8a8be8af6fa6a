"""The live phase flip: move the one logical state to another layout and swap the binding.

`Layouts.flip(layout)` checks the target (a `LayoutError` leaves everything as it was), makes
sure the target's step programs are compiled (`Layouts.arm`; a flip to an armed layout compiles
nothing), copies every leaf to its target sharding with `jax.device_put` (device to device,
never through the host), verifies every copy landed where the placement says, and only then
swaps `runner.binding`; `Layouts` keeps the generation and the flip records. Until the swap
the old binding serves and owns every array, so a failure at any point before it loses nothing.
After the swap nothing refers to the old arrays, so they are freed; they are not deleted by
hand, because a shard that already sat where the target wants it may be shared by the new
array rather than copied.

Requests in flight need nothing: page and slot ids are logical, the scheduler's tables keep
their meaning, and the next step simply runs on the new binding. The copy is not donated: a
donated move that failed half way would leave neither layout whole. The price is that the
state is briefly held twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from flipjax.runtime import cache_io
from flipjax.runtime.binding import Binding, compile_programs
from flipjax.runtime.cache import CacheState
from flipjax.runtime.model_runner import ModelRunner
from flipjax.runtime.placement import Placement
from sharding.layout import Layout, parse_layout, placement_for


class FlipError(RuntimeError):
    """A flip failed before the swap; the old layout is still bound and serving."""


@dataclass(frozen=True)
class FlipRecord:
    """What one flip moved and how long each part took."""

    source: str
    target: str
    generation: int  # the binding generation after this flip
    weights_bytes: int
    kv_bytes: int
    gdn_bytes: int
    weights_ms: float
    kv_ms: float
    gdn_ms: float
    total_ms: float

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
    moved = jax.block_until_ready(jax.device_put(tree, shardings))
    return moved, (time.perf_counter() - t0) * 1e3


def arm(runner: ModelRunner, placement: Placement, state_io: bool = False) -> None:
    """Compile everything a flip to `placement` and back would compile.

    That is the target's step programs for every serving shape, and the transfer programs
    `jax.device_put` builds to reshard each leaf between the two placements: those are warmed
    by a trial move of the state there and back (results dropped), which also proves the
    target can hold the state before a flip relies on it. Transfers are warmed between the
    current layout and the target only; arm from the layout you will flip from. With
    `state_io`, the programs that move pages and states (prefix cache and store) are warmed
    on the trial copy too. The binding is not touched.
    """
    skeleton = runner.binding.rebind(placement, runner.binding.params, runner.binding.state)
    shapes = set(runner.shapes)
    for b, t in runner.shapes:  # the pieces a pipeline cuts steps into
        shapes.add(skeleton.split(b, t)[1:])
    with runner.compiles.watch():
        compile_programs(skeleton, sorted(shapes))
        current = runner.binding
        if placement.key != current.placement.key:
            source = (current.params, current.state)
            there = jax.block_until_ready(jax.device_put(source, _shardings(runner, placement)))
            back = jax.device_put(there, _shardings(runner, current.placement))
            jax.block_until_ready(back)
            if state_io:  # on a copy: device_put may hand back a leaf already placed there
                cache_io.warm(jax.tree.map(jnp.copy, there[1]), runner.table_width)
            del there, back


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
    of `runner.binding` after the engine is built."""

    def __init__(self, runner: ModelRunner, state_io: bool = False):
        self.runner = runner
        self.state_io = state_io  # also warm the page and state moves of the prefix cache/store
        self.armed: dict[str, Placement] = {runner.binding.placement.name: runner.binding.placement}
        self.generation = 0
        self.flips: list[FlipRecord] = []

    @property
    def current(self) -> str:
        return self.runner.binding.placement.name

    def arm(self, layout: str | Layout) -> Placement:
        """Check `layout` (`LayoutError` when the model or the devices cannot take it) and
        compile everything a flip to it and back needs; the binding is not touched."""
        placement = placement_for(layout, self.runner.cfg)
        arm(self.runner, placement, self.state_io)
        self.armed[placement.name] = placement
        return placement

    def flip(self, layout: str | Layout) -> FlipRecord | None:
        """Move the runner's state to `layout`; None when it is already there."""
        runner = self.runner
        old = runner.binding
        placement = self.armed.get(str(parse_layout(layout))) or self.arm(layout)
        if placement.key == old.placement.key:
            return None
        t0 = time.perf_counter()
        try:
            with runner.compiles.watch():  # a compile here would be on the critical path
                new, moved = _placed_copy(runner, placement)
        except FlipError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure here must leave the old layout bound
            raise FlipError(f"flip to {placement.name} failed before the swap: {err}") from err
        runner.binding = new  # the swap: from here on every reader sees the new layout
        self.generation += 1
        record = FlipRecord(
            source=old.placement.name,
            target=placement.name,
            generation=self.generation,
            total_ms=(time.perf_counter() - t0) * 1e3,
            **moved,
        )
        self.flips.append(record)
        return record


def _placed_copy(runner: ModelRunner, placement: Placement) -> tuple[Binding, dict[str, Any]]:
    """Copy every leaf to `placement`, check where each landed, and bind the copies.

    Returns the new binding and what was moved (bytes and ms per part).
    """
    old = runner.binding
    param_sh, state_sh = _shardings(runner, placement)
    params, weights_ms = _move(old.params, param_sh)
    kv, kv_ms = _move(old.state.kv, state_sh.kv)
    gdn, gdn_ms = _move(old.state.gdn, state_sh.gdn)
    _check_landed(params, param_sh, "weight")
    _check_landed((kv, gdn), (state_sh.kv, state_sh.gdn), "pool")
    new = old.rebind(placement, params, CacheState(kv=kv, gdn=gdn))
    moved = dict(
        weights_bytes=_nbytes(params), kv_bytes=_nbytes(kv), gdn_bytes=_nbytes(gdn),
        weights_ms=weights_ms, kv_ms=kv_ms, gdn_ms=gdn_ms,
    )  # fmt: skip
    return new, moved
