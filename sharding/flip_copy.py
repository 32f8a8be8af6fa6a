"""The pieces of a flip besides its choreography: its error and record, arming a layout, the
device-to-device copy a cluster flips by, and the check that every leaf landed where its
placement says (`sharding.flip` runs them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax

from flipjax.runtime import cache_io
from flipjax.runtime.binding import Binding, compile_programs
from flipjax.runtime.cache import CacheState, kv_scaled
from flipjax.runtime.crosshost import reshard
from flipjax.runtime.model_runner import ModelRunner
from flipjax.runtime.placement import Placement
from sharding.flip_waves import compile_all
from sharding.movers import move_live, warm


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


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _move(tree: Any, shardings: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    moved = jax.block_until_ready(reshard(tree, shardings))
    return moved, (time.perf_counter() - t0) * 1e3


def _move_pools(
    state: CacheState, shardings: CacheState, pages: list[int], slots: list[int]
) -> tuple[CacheState, dict[str, float]]:
    return move_live(state, shardings, pages, slots)


def arm(
    runner: ModelRunner,
    placement: Placement,
    state_io: bool = False,
    window: dict[int, int] | None = None,
    pools: CacheState | None = None,
) -> None:
    """Compile everything a flip to `placement` and back would compile; `pools` (shapes) is
    the target's pool when its size differs from the current one's.

    A windowed flip (`window` given) needs the target's step programs and the pool programs of
    `sharding.flip_waves`, all compiled from shapes. Otherwise (a cluster's copy):

    the target's step programs for every serving shape, the transfer programs
    `jax.device_put` builds to reshard the parameters (warmed by a trial move there and back),
    and the live-set movers of the pools for every bucket of rows. Transfers are warmed between
    the current layout and the target only; arm from the layout you will flip from. With
    `state_io`, the programs that move pages and states (prefix cache and store) are compiled
    for the target's pools too, from shapes. The binding is not touched.
    """
    current = runner.binding
    target = pools if pools is not None else current.state
    scaled = kv_scaled(target)
    skeleton = current.rebind(placement, current.params, target)
    shapes = set(runner.shapes)
    for b, t in runner.shapes:  # the pieces a pipeline cuts steps into
        shapes.add(skeleton.split(b, t)[1:])
    with runner.compiles.watch():
        compile_programs(skeleton, sorted(shapes))
        if window is not None:  # the windowed flip's programs, from shapes: nothing allocated
            sides = [(current.state, current.placement), (target, placement)]
            compile_all(
                [
                    (
                        [(tuple(x.shape), x.dtype) for x in jax.tree.leaves(state)],
                        jax.tree.leaves(side.state_shardings(runner.cfg, kv_scales=scaled)),
                    )
                    for state, side in sides
                ],
                window,
            )
            if state_io:
                cache_io.warm_shapes(
                    target,
                    placement.state_shardings(runner.cfg, kv_scales=scaled),
                    runner.table_width,
                )
        elif placement.key != current.placement.key:
            (there_sh, target_sh), (back_sh, source_sh) = (
                shardings_of(runner, placement),
                shardings_of(runner, current.placement),
            )
            there = jax.block_until_ready(reshard(current.params, there_sh))
            jax.block_until_ready(reshard(there, back_sh))
            warm(current.state, source_sh, target_sh)
            if state_io:
                cache_io.warm_shapes(current.state, target_sh, runner.table_width)


def shardings_of(runner: ModelRunner, placement: Placement) -> tuple[Any, Any]:
    return (
        placement.param_shardings(runner.binding.params),
        placement.state_shardings(runner.cfg, kv_scales=kv_scaled(runner.state)),
    )


def _check_landed(tree: Any, shardings: Any, what: str) -> None:
    for leaf, want in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            raise FlipError(f"flip: a {what} leaf landed on {leaf.sharding}, not {want}")


def placed_copy(
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
    moved = dict(
        weights_bytes=nbytes(params),
        weights_ms=weights_ms,
        **pools,
        check_ms=landed_ms(params, param_sh, state, state_sh),
    )
    return old.rebind(placement, params, state), moved


def landed_ms(params: Any, param_sh: Any, state: CacheState, state_sh: CacheState) -> float:
    """Check every leaf landed where the placement says (`FlipError` if not); the ms taken."""
    t0 = time.perf_counter()
    _check_landed(params, param_sh, "weight")
    _check_landed(state, state_sh, "pool")
    return (time.perf_counter() - t0) * 1e3
