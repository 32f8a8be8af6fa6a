"""How many KV pages the engine's pool gets: as many as every layout it will run (the live one
and those it arms at start) can hold within the device budgets, capped by `--num-pages`; 1024
where no device has a budget.

A pool no larger than the smallest layout's capacity is one a flip between those layouts never
has to shrink; the capacity of each is logged (`Engine.memory()`), so what a larger per-layout
pool would gain is visible. Each layout's workspace is measured by compiling its largest
steps (`probe_workspace`) before anything is placed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
from flax import nnx

from flipjax.runtime.cache import init_cache_state
from flipjax.runtime.model_runner import RunnerShape
from flipjax.runtime.placement import Placement
from flipjax.runtime.workspace_probe import probe_workspace
from sharding.budgets import BudgetError, format_bytes
from sharding.ledger import Capacity, pages_within

DEFAULT_NUM_PAGES = 1024


def pool_pages(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    shape: RunnerShape,
    placements: Sequence[Placement],
    budgets: Mapping[int, int] | None,
    cap: int | None,
) -> int:
    """The pool's page count for `placements` (the live one first) within `budgets`; `cap`
    (`--num-pages`) when smaller, or when no device has a budget. BudgetError naming the
    tightest device when a budget leaves no room for one page."""
    if budgets is None:
        return cap if cap is not None else DEFAULT_NUM_PAGES
    # Without any workspace the pool could be at most this; the steps' temporaries are then
    # measured over a pool of that size (they grow a little with it, so what they take at
    # the final, smaller size is no more), or of the cap's, which is then the engine's own.
    bound = _tightest(capacities_of(params, shape, placements, budgets, None))
    if bound is None:
        return cap if cap is not None else DEFAULT_NUM_PAGES
    probe_pages = max(1, min(bound.pages or 1, cap or bound.pages or 1))
    probed = dataclasses.replace(shape, num_pages=probe_pages)
    work = [probe_workspace(graphdef, params, probed, p) for p in placements]
    tightest = _tightest(capacities_of(params, shape, placements, budgets, work))
    assert tightest is not None
    if not tightest.pages:
        raise BudgetError(
            f"device_memory: in {tightest.layout}, device {tightest.device} needs "
            f"{format_bytes(tightest.page_bytes or 0)} for one KV page, but its budget of "
            f"{format_bytes(tightest.budget or 0)} leaves {format_bytes(tightest.room or 0)} "
            f"beside its weights, GDN slots, workspace and reserve"
        )
    return min(tightest.pages, cap) if cap is not None else tightest.pages


def _tightest(capacities: list[Capacity]) -> Capacity | None:
    known = [c for c in capacities if c.pages is not None]
    return min(known, key=lambda c: c.pages or 0) if known else None


def capacities_of(
    params: nnx.State,
    shape: RunnerShape,
    placements: Sequence[Placement],
    budgets: Mapping[int, int],
    work: Sequence[Mapping[int, int]] | None,
) -> list[Capacity]:
    """Each placement's capacity within `budgets`, with its workspace by device id (`work`,
    one per placement; None: none)."""
    cfg, pages = shape.cfg, shape.num_pages
    state = jax.eval_shape(
        lambda: init_cache_state(cfg, pages, shape.page_size, shape.num_slots, shape.dtype)
    )
    works = work if work is not None else [{} for _ in placements]
    return [
        pages_within(p, cfg, params, state, pages, budgets, w, 0, shape.page_size)
        for p, w in zip(placements, works, strict=True)
    ]
