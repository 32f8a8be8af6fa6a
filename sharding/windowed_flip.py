"""The windowed flip's plan: each device's window, whether the flip fits, and the copy itself
(`sharding.flip_waves` holds the waves it runs).

The window is what a flip may hold on a device beyond the larger of its old and new footprint:
`--flip-window` when given, else 5% of the device's budget, else (no budget) 5% of that larger
footprint. With budgets, a flip is refused before anything moves unless every device can hold
that peak, and afterwards the new layout's weights, pools, workspace and reserve.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flipjax.runtime.binding import Binding
from flipjax.runtime.cache import CacheState
from flipjax.runtime.host_image import HostImage
from sharding.budgets import format_bytes, reserve
from sharding.flip_waves import OnWave, PoolLeaf, delete_all, land, pull

WINDOW_FRACTION = 0.05
MIN_WINDOW = 2**20


class Restored(Exception):
    """A windowed copy failed after the old arrays were freed; `binding` is the old layout
    landed again from the host copies."""

    def __init__(self, binding: Binding, cause: BaseException):
        super().__init__(str(cause))
        self.binding = binding
        self.cause = cause


def windows(
    old: Counter[int],
    new: Counter[int],
    budgets: Mapping[int, int] | None,
    flip_window: int | None,
) -> dict[int, int]:
    """Each device's window (by id), over every device either layout uses."""
    out = {}
    for device in set(old) | set(new):
        if flip_window is not None:
            out[device] = flip_window
        elif budgets is not None and device in budgets:
            out[device] = int(budgets[device] * WINDOW_FRACTION)
        else:
            larger = max(old[device], new[device])
            out[device] = max(MIN_WINDOW, int(larger * WINDOW_FRACTION))
    return out


def shortfall(
    target: str,
    old: Counter[int],
    new: Counter[int],
    window: Mapping[int, int],
    workspace: Counter[int],
    budgets: Mapping[int, int] | None,
    headroom: int | None = None,
) -> str | None:
    """Why a flip to `target` does not fit the budgets (or, on a device without one, what
    `--flip-memory-headroom` lets a flip add), naming the device, the need and the limit; None
    when it fits or nothing limits it."""
    for device in sorted(set(old) | set(new)):
        budget = None if budgets is None else budgets.get(device)
        if budget is None:
            grows = max(0, new[device] - old[device]) + window[device]
            if headroom is not None and grows > headroom:
                return (
                    f"device {device} needs {format_bytes(grows)} beyond what it holds for "
                    f"{target} (its growth plus the window), {format_bytes(headroom)} are "
                    f"free (--flip-memory-headroom)"
                )
            continue
        peak = max(old[device], new[device]) + window[device]
        after = new[device] + workspace[device] + reserve(budget)
        if peak > budget:
            return (
                f"device {device} needs {format_bytes(peak)} during the flip (the larger of "
                f"{format_bytes(old[device])} now and {format_bytes(new[device])} in {target}, "
                f"plus the {format_bytes(window[device])} window), over its budget of "
                f"{format_bytes(budget)}"
            )
        if after > budget:
            return (
                f"device {device} needs {format_bytes(after)} in {target} (weights and pools "
                f"{format_bytes(new[device])}, workspace {format_bytes(workspace[device])}, "
                f"reserve {format_bytes(reserve(budget))}), over its budget of "
                f"{format_bytes(budget)}"
            )
    return None


def _live(state: Any, page_ids: Sequence[int], slot_ids: Sequence[int]) -> list[PoolLeaf]:
    """Each pool leaf of `state` (arrays or shapes) with its live rows, leaf for leaf."""
    pages, slots = np.asarray(page_ids, np.int32), np.asarray(slot_ids, np.int32)
    kv, gdn = jax.tree.leaves(state.kv), jax.tree.leaves(state.gdn)
    live = [pages] * len(kv) + [slots] * len(gdn)
    return [PoolLeaf(tuple(x.shape), x.dtype, ids) for x, ids in zip(kv + gdn, live, strict=True)]


def windowed_copy(
    old: Binding,
    placement: Any,
    param_sh: Any,
    state_sh: CacheState,
    image: HostImage,
    pages: Sequence[int],
    slots: Sequence[int],
    window: Mapping[int, int],
    check: Callable[[Any, CacheState], float],
    on_wave: OnWave | None = None,
    target: CacheState | None = None,
    page_dst: Mapping[int, int] | None = None,
) -> tuple[Binding, dict[str, Any]]:
    """The state of `old` on `placement`, moved within `window` (`sharding.flip_waves`), and
    what was moved. `target` (shapes) is the new pool when its size differs, and `page_dst`
    says where a live page lands there when not at its own id. `check` raises if a leaf
    landed elsewhere (it returns the ms it took). A failure in the pull raises with `old`
    untouched; a later one raises `Restored`, carrying the old layout landed again."""
    state = old.state
    weights, pool_leaves = jax.tree.leaves(old.params), jax.tree.leaves(state)
    weight_sh, pool_sh = jax.tree.leaves(param_sh), jax.tree.leaves(state_sh)
    page_ids, slot_ids = sorted(pages), sorted(slots)
    live = _live(state, page_ids, slot_ids)
    dst = page_dst or {}
    there = _live(target or state, [dst.get(p, p) for p in page_ids], slot_ids)
    # A leaf already laid out (and sized) as the target wants it stays: it is in both
    # footprints.
    moving_w = _moving(weights, weight_sh)
    resized = [i for i, (a, b) in enumerate(zip(live, there, strict=True)) if a.shape != b.shape]
    moving_p = sorted(set(_moving(pool_leaves, pool_sh)) | set(resized))
    num_kv = len(jax.tree.leaves(state.kv))
    kinds = [[i for i in moving_p if i < num_kv], [i for i in moving_p if i >= num_kv]]
    rows: dict[int, np.ndarray] = {}
    pull_ms = []
    for kind in kinds:
        t0 = time.perf_counter()
        pulled = pull([pool_leaves[i] for i in kind], [live[i].ids for i in kind], window, on_wave)
        rows.update(zip(kind, pulled, strict=True))
        pull_ms.append((time.perf_counter() - t0) * 1e3)
    old_weight_sh = [x.sharding for x in weights]
    old_pool_sh = [x.sharding for x in pool_leaves]
    jax.block_until_ready((old.params, state))  # nothing still computing on what is freed
    delete_all([weights[i] for i in moving_w] + [pool_leaves[i] for i in moving_p])
    moving_rows = [rows[i] for i in moving_p]

    def land_on(
        w_sh: list[Any],
        p_sh: list[Any],
        pools: list[PoolLeaf],
        waves: OnWave | None,
        landed: list[jax.Array],
    ) -> tuple[Any, Any, list[float]]:
        """The moving leaves landed on these shardings as `pools` say (the others stay)."""
        targets = [p_sh[i] for i in moving_p]
        moving = [pools[i] for i in moving_p]
        args = (moving, targets, moving_rows, window, waves, landed)
        placed, made, ms = land(image, w_sh, moving_w, *args)
        params = image.tree([placed.get(i, x) for i, x in enumerate(weights)])
        return params, _state(state, pool_leaves, dict(zip(moving_p, made, strict=True))), ms

    landed: list[jax.Array] = []
    try:
        params, new_state, ms = land_on(weight_sh, pool_sh, there, on_wave, landed)
        check_ms = check(params, new_state)
    except BaseException as err:
        delete_all(landed)
        params, back, _ = land_on(old_weight_sh, old_pool_sh, live, None, [])
        raise Restored(old.rebind(old.placement, params, back), err) from err
    pool_ms = dict(zip(moving_p, ms[1:], strict=True))
    moved = dict(
        weights_bytes=sum(image.leaves[i].nbytes for i in moving_w),
        weights_ms=ms[0],
        kv_bytes=sum(rows[i].nbytes for i in kinds[0]),  # the live rows, out and back
        gdn_bytes=sum(rows[i].nbytes for i in kinds[1]),
        kv_ms=pull_ms[0] + sum(pool_ms[i] for i in kinds[0]),
        gdn_ms=pull_ms[1] + sum(pool_ms[i] for i in kinds[1]),
        check_ms=check_ms,
    )
    return old.rebind(placement, params, new_state), moved


def _moving(leaves: Sequence[jax.Array], targets: Sequence[Any]) -> list[int]:
    """Indices of the leaves not already laid out as their targets say."""
    return [
        i
        for i, (x, want) in enumerate(zip(leaves, targets, strict=True))
        if not x.sharding.is_equivalent_to(want, x.ndim)
    ]


def _state(state: CacheState, leaves: Sequence[jax.Array], new: dict[int, jax.Array]) -> Any:
    """`state`'s structure over `leaves`, with those at the indices of `new` replaced."""
    merged = [new.get(i, x) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(jax.tree.structure(state), merged)
