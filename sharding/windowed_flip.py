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
from sharding.memory import bytes_per_device

WINDOW_FRACTION = 0.05
MIN_WINDOW = 2**20


class Restored(Exception):
    """A windowed copy failed after the old arrays were freed; `binding` is the old layout
    landed again from the host copies."""

    def __init__(self, binding: Binding, cause: BaseException):
        super().__init__(str(cause))
        self.binding = binding
        self.cause = cause


def footprints(trees: Any, shardings: Any) -> Counter[int]:
    """Bytes each device (by id) holds of `trees` laid out by `shardings`."""
    return Counter({d.id: n for d, n in bytes_per_device(trees, shardings).items()})


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


def _live(state: CacheState, pages: Sequence[int], slots: Sequence[int]) -> list[PoolLeaf]:
    page_ids = np.asarray(sorted(pages), np.int32)
    slot_ids = np.asarray(sorted(slots), np.int32)
    kv, gdn = jax.tree.leaves(state.kv), jax.tree.leaves(state.gdn)
    live = [page_ids] * len(kv) + [slot_ids] * len(gdn)
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
) -> tuple[Binding, dict[str, Any]]:
    """The state of `old` on `placement`, moved within `window` (`sharding.flip_waves`), and
    what was moved. `check` raises if a leaf landed elsewhere (it returns the ms it took). A
    failure in the pull raises with `old` untouched; a later one raises `Restored`, carrying
    the old layout landed again."""
    state = old.state
    leaves = jax.tree.leaves(state)
    pools = _live(state, pages, slots)
    num_kv = len(jax.tree.leaves(state.kv))
    t0 = time.perf_counter()
    rows = pull(leaves[:num_kv], [p.ids for p in pools[:num_kv]], window, on_wave)
    t1 = time.perf_counter()
    rows += pull(leaves[num_kv:], [p.ids for p in pools[num_kv:]], window, on_wave)
    pull_ms = [(t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3]  # KV, GDN
    old_param_sh = jax.tree.map(lambda x: x.sharding, old.params)
    old_state_sh = jax.tree.map(lambda x: x.sharding, state)
    treedef = jax.tree.structure(state)
    jax.block_until_ready((old.params, state))  # nothing still computing on what is freed
    delete_all(jax.tree.leaves(old.params) + leaves)
    landed: list[jax.Array] = []
    try:
        params, pool_leaves, ms = land(
            image, param_sh, state_sh, pools, rows, window, on_wave, landed
        )
        new_state = jax.tree.unflatten(treedef, pool_leaves)
        check_ms = check(params, new_state)
    except BaseException as err:
        delete_all(landed)
        params, pool_leaves, _ = land(
            image, old_param_sh, old_state_sh, pools, rows, window, None, []
        )
        back = old.rebind(old.placement, params, jax.tree.unflatten(treedef, pool_leaves))
        raise Restored(back, err) from err
    moved = dict(
        weights_bytes=image.nbytes,
        weights_ms=ms[0],
        kv_bytes=sum(r.nbytes for r in rows[:num_kv]),  # the live rows, out and back
        gdn_bytes=sum(r.nbytes for r in rows[num_kv:]),
        kv_ms=pull_ms[0] + sum(ms[1 : 1 + num_kv]),
        gdn_ms=pull_ms[1] + sum(ms[1 + num_kv :]),
        check_ms=check_ms,
    )
    return old.rebind(placement, params, new_state), moved
