"""The per-device memory ledger: what the engine holds on each device, by kind, beside the
device's budget, and how many KV pages each layout could hold within the budgets.

Kinds: the weights, the KV pages, the GDN state slots (the device prefix cache's states
included: they live in the same pools), a speculative drafter's weights and KV pages (on the
sampler's device), the workspace (the largest temporary memory of any
step program compiled for the layout, from `compiled.memory_analysis()`) and the reserve (a
share of the budget kept free for a flip's transfers and the allocator's slack). Bytes are read
from the placed arrays' shardings, so the ledger says what the devices hold, not what a formula
expects them to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flipjax.model.config import ModelConfig
from flipjax.runtime.binding import Binding
from flipjax.runtime.cache import kv_scaled, resized
from flipjax.runtime.placement import Placement
from flipjax.runtime.workspace_probe import workspace
from sharding.budgets import format_bytes, reserve
from sharding.memory import bytes_per_device, held_bytes
from sharding.pool_sizing import Footprint, footprint, plus, tightest

KINDS = ("weights", "kv_pages", "gdn_slots", "drafter", "workspace", "reserve")


@dataclass(frozen=True)
class DeviceMemory:
    """One device's line of the ledger: bytes by kind (`KINDS`) and its budget, if it has one."""

    device: int
    budget: int | None
    bytes: Mapping[str, int]

    @property
    def used(self) -> int:
        return sum(self.bytes.values())

    @property
    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self.used


@dataclass(frozen=True)
class Capacity:
    """How many KV pages a layout's devices can hold within their budgets: the tightest
    device's count (`device`), or None where a device has no budget."""

    layout: str
    pages: int | None
    tokens: int | None
    device: int | None


def account(
    binding: Binding,
    budgets: Mapping[int, int] | None,
    work: Counter[int] | None = None,
    drafter: Counter[int] | None = None,
) -> tuple[DeviceMemory, ...]:
    """The ledger of the binding's devices: what its placed weights and pools hold on each,
    what a drafter holds (`drafter`, bytes by device id), its compiled programs' workspace
    (`work`, when already read), and the reserve of each budget."""
    state = binding.state
    kinds = {
        "weights": held_bytes(binding.params),
        "kv_pages": held_bytes(state.kv),
        "gdn_slots": held_bytes(state.gdn),
        "drafter": drafter if drafter is not None else Counter(),
        "workspace": work if work is not None else workspace(binding),
    }
    ids = [device.id for device in binding.placement.devices]
    ids += sorted(d for d, n in kinds["drafter"].items() if n and d not in ids)
    lines = []
    for device in ids:
        budget = None if budgets is None else budgets.get(device)
        counts = {kind: held[device] for kind, held in kinds.items()}
        lines.append(DeviceMemory(device, budget, counts | {"reserve": reserve(budget)}))
    return tuple(lines)


def capacity(
    binding: Binding,
    placement: Placement,
    budgets: Mapping[int, int] | None,
    num_pages: int,
    page_size: int,
    own_work: Counter[int],
    beside: Footprint | None = None,
) -> Capacity:
    """The KV pages `placement` could hold within `budgets`, beside what the binding's weights
    and GDN slots would take there (`sharding.pool_sizing`'s rule for one layout). The
    workspace is that of the placement's compiled programs, else the largest of the binding's
    own (`own_work`)."""
    none = Capacity(placement.name, None, None, None)
    if budgets is None or any(d.id not in budgets for d in placement.devices):
        return none
    compiled = workspace(binding, placement)
    largest = max(own_work.values(), default=0)
    work = {d.id: compiled.get(d.id, largest) for d in placement.devices}
    held = footprint(placement, binding.cfg, binding.params, binding.state, num_pages, work)
    held = plus(held, beside)
    if not any(held.page.values()):
        return none  # no attention layer: no pages to hold
    limit = tightest([placement], [held], budgets)
    return Capacity(placement.name, limit.pages, limit.pages * page_size, limit.device)


def overdraft(
    placement: Placement,
    cfg: ModelConfig,
    params: Any,
    state: Any,
    budgets: Mapping[int, int] | None,
) -> str | None:
    """Why `params` and `state` (arrays or shapes) laid out by `placement` do not fit the
    budgets, naming the device, the need and the budget (the reserve kept free); None when
    they fit or no device has a budget."""
    if budgets is None:
        return None
    need = bytes_per_device(params, placement.param_shardings(params))
    need += bytes_per_device(state, placement.state_shardings(cfg, kv_scales=kv_scaled(state)))
    for device in sorted(need, key=lambda d: d.id):
        budget = budgets.get(device.id)
        if budget is not None and need[device] > budget - reserve(budget):
            return (
                f"device {device.id} needs {format_bytes(need[device])} for the weights and "
                f"pools of {placement.name}, over its budget of {format_bytes(budget)} less "
                f"the {format_bytes(reserve(budget))} reserve"
            )
    return None


@dataclass(frozen=True)
class MemoryReport:
    """The ledger of the live layout's devices, and the KV capacity of the live layout and of
    each armed one within the budgets."""

    layout: str
    devices: tuple[DeviceMemory, ...]
    capacity: tuple[Capacity, ...]

    def table(self) -> str:
        return table(self.devices, self.layout) + "\n" + capacity_line(list(self.capacity))


def report(
    binding: Binding,
    budgets: Mapping[int, int] | None,
    armed: Iterable[Placement],
    num_pages: int,
    page_size: int,
    sizes: Mapping[str, int] | None = None,
    drafter: tuple[Counter[int], Footprint] | None = None,
) -> MemoryReport:
    """The ledger and the capacities (the live layout first) between two steps; `sizes` is
    the pool each layout has where it differs from the live one's `num_pages` (its programs,
    whose workspace counts, were compiled for that pool); `drafter`: what a speculative
    drafter holds (bytes by device id) and its footprint (`pool_sizing.pool_pages`'s
    `beside`)."""
    held, beside = drafter if drafter is not None else (None, None)
    placements = [binding.placement]
    placements += [p for p in armed if p.key != binding.placement.key]
    own = workspace(binding)
    capacities = []
    for p in placements:
        pages = (sizes or {}).get(p.name, num_pages)
        pools = resized(binding.state, pages)
        there = binding if pools is None else binding.rebind(p, binding.params, pools)
        capacities.append(capacity(there, p, budgets, pages, page_size, own, beside))
    ledger = account(binding, budgets, own, held)
    return MemoryReport(binding.placement.name, ledger, tuple(capacities))


def table(lines: tuple[DeviceMemory, ...], layout: str) -> str:
    """The ledger as one table, a line per device."""
    head = f"memory per device ({layout}):\n{'device':>6} {'budget':>10}"
    head += "".join(f" {kind:>10}" for kind in KINDS) + f" {'free':>10}"
    rows = [head]
    for line in lines:
        budget = "-" if line.budget is None else format_bytes(line.budget)
        free = "-" if line.free is None else format_bytes(line.free)
        cells = "".join(f" {format_bytes(line.bytes[kind]):>10}" for kind in KINDS)
        rows.append(f"{line.device:>6} {budget:>10}{cells} {free:>10}")
    return "\n".join(rows)


def capacity_line(capacities: list[Capacity]) -> str:
    """`KV capacity: pp:5,3 = N pages (T tokens); tp:2 = M pages (...)`."""
    parts = [
        f"{c.layout} = {c.pages} pages ({c.tokens} tokens, device {c.device} the tightest)"
        if c.pages is not None
        else f"{c.layout} = no budget"
        for c in capacities
    ]
    return "KV capacity: " + "; ".join(parts)
