"""How many KV pages a layout's pool gets: the most its devices can hold within the device
budgets, capped by `--num-pages`; 1024 where no device has a budget.

In one process a flip moves within a window (`sharding.windowed_flip`): a device never holds
more than the larger of the two layouts plus the window, which the reserve and the workspace
(idle during a flip) cover, so each layout alone sets its own pool (`pool_pages` over one
placement; a flip resizes the pool, `sharding.flip_pools`). Across processes a flip holds the
old and the new layout at once (`flips_hold_both`), so there one size serves every layout and
each pair of layouts is a limit too. Each layout's workspace is measured by compiling its
largest steps from shapes (`probe_workspace`) before anything is placed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.runtime.cache import CacheState, kv_scaled
from flipjax.runtime.placement import Placement
from flipjax.runtime.runner_shape import RunnerShape
from flipjax.runtime.workspace_probe import probe_workspace
from sharding.budgets import BudgetError, format_bytes, reserve
from sharding.memory import bytes_by_id

DEFAULT_NUM_PAGES = 1024


class Footprint(NamedTuple):
    """Per device id: the bytes that do not grow with the pool (weights, GDN slots), those of
    one KV page, and the workspace."""

    fixed: Counter[int]
    page: Counter[int]
    work: Mapping[int, int]


class Limit(NamedTuple):
    pages: int
    what: str  # the layout, or the flip, that sets it
    device: int
    room: int
    page_bytes: int


def pool_pages(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    shape: RunnerShape,
    placements: Sequence[Placement],
    budgets: Mapping[int, int] | None,
    cap: int | None,
    flips_hold_both: bool = False,
    beside: Footprint | None = None,
) -> int:
    """The pool's page count for `placements` (the live one first) within `budgets`; `cap`
    (`--num-pages`) when smaller, or when no device has a budget. `beside`: what every layout
    holds besides (a speculative drafter's weights, and its KV per page of the pool).
    BudgetError naming the device and the layout or flip when a budget leaves no room for one
    page."""
    if budgets is None or not _budgeted(placements, budgets):
        return cap if cap is not None else DEFAULT_NUM_PAGES
    # Without any workspace the pool could be at most this; the steps' temporaries are then
    # measured over a pool of that size (or of the cap's, which is then the engine's own).
    one = shape.pools(1)
    free = [plus(footprint(p, shape.cfg, params, one, 1, {}), beside) for p in placements]
    if not any(n for f in free for n in f.page.values()):
        return cap if cap is not None else DEFAULT_NUM_PAGES  # no attention layer: no pages
    bound = tightest(placements, free, budgets, flips_hold_both)
    if bound.pages < 1:
        _refuse(bound)  # a workspace only takes more
    probe_pages = max(1, min(bound.pages, cap) if cap is not None else bound.pages)
    probed = dataclasses.replace(shape, num_pages=probe_pages)
    work = [probe_workspace(graphdef, params, probed, p) for p in placements]
    prints = [
        plus(footprint(p, shape.cfg, params, one, 1, w), beside)
        for p, w in zip(placements, work, strict=True)
    ]
    limit = tightest(placements, prints, budgets, flips_hold_both)
    if limit.pages < 1:
        _refuse(limit)
    return min(limit.pages, cap) if cap is not None else limit.pages


def _refuse(limit: Limit) -> None:
    raise BudgetError(
        f"device_memory: {limit.what} leaves device {limit.device} "
        f"{format_bytes(limit.room)} for KV pages beside its weights, GDN slots, workspace "
        f"and reserve, and a page takes {format_bytes(limit.page_bytes)} there"
    )


def _budgeted(placements: Sequence[Placement], budgets: Mapping[int, int]) -> bool:
    return all(d.id in budgets for p in placements for d in p.devices)


def footprint(
    placement: Placement,
    cfg: ModelConfig,
    params: Any,
    state: CacheState,
    num_pages: int,
    work: Mapping[int, int],
) -> Footprint:
    """What `placement` holds per device of `params` and of `state` (arrays or shapes, with
    `num_pages` pages), with the workspace `work`."""
    shardings = placement.state_shardings(cfg, kv_scales=kv_scaled(state))
    fixed = bytes_by_id(params, placement.param_shardings(params))
    fixed += bytes_by_id(state.gdn, shardings.gdn)
    page = Counter({d: n // num_pages for d, n in bytes_by_id(state.kv, shardings.kv).items()})
    return Footprint(fixed, page, work)


def plus(held: Footprint, beside: Footprint | None) -> Footprint:
    """`held` with what is held beside it (None: nothing) on the same devices or others."""
    if beside is None:
        return held
    work = Counter(held.work) + Counter(beside.work)
    return Footprint(held.fixed + beside.fixed, held.page + beside.page, work)


def tightest(
    placements: Sequence[Placement],
    prints: Sequence[Footprint],
    budgets: Mapping[int, int],
    flips_hold_both: bool = False,
) -> Limit:
    """The smallest page count any layout alone (or, when `flips_hold_both`, any flip between
    two: both footprints at once) allows on any device."""
    cases = [(p.name, (f,)) for p, f in zip(placements, prints, strict=True)]
    if flips_hold_both:
        pairs = itertools.permutations(zip(placements, prints, strict=True), 2)
        cases += [(f"a flip {a.name} -> {b.name}", (fa, fb)) for (a, fa), (b, fb) in pairs]
    limits = []
    for what, footprints in cases:
        devices = set().union(*(f.fixed.keys() | f.page.keys() for f in footprints))
        for device in devices:
            page = sum(f.page[device] for f in footprints)
            if page == 0:
                continue  # a device without attention layers here holds no pages
            budget = budgets.get(device)
            if budget is None:
                continue  # a device outside every layout (a drafter's) without a budget
            work = max(f.work.get(device, 0) for f in footprints)
            room = budget - reserve(budget) - work - sum(f.fixed[device] for f in footprints)
            limits.append(Limit(max(0, room // page), what, device, room, page))
    return min(limits)
