"""The per-device memory ledger: what the engine holds on each device, by kind, beside the
device's budget, and how many KV pages each layout could hold within the budgets.

Kinds: the weights, the KV pages, the GDN state slots (the device prefix cache's states
included: they live in the same pools), the workspace (the largest temporary memory of any
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
from flipjax.runtime.placement import Placement
from flipjax.runtime.workspace_probe import temp_bytes
from sharding.budgets import format_bytes, reserve
from sharding.memory import bytes_per_device, held_bytes

KINDS = ("weights", "kv_pages", "gdn_slots", "workspace", "reserve")


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


def workspace(binding: Binding, placement: Placement | None = None) -> Counter[int]:
    """Per device (by id), the largest temporary memory of the step and write programs
    compiled so far for `placement` (default: the binding's own) and this binding's model and
    pools."""
    placement = placement or binding.placement
    work: Counter[int] = Counter()
    for stage, step, write in binding.compiled(placement):
        temp = max(temp_bytes(step), temp_bytes(write))
        for device in placement.stages[stage].mesh.devices.flat:
            work[device.id] = max(work[device.id], temp)
    return work


def account(binding: Binding, budgets: Mapping[int, int] | None) -> tuple[DeviceMemory, ...]:
    """The ledger of the binding's devices: what its placed weights and pools hold on each,
    its compiled programs' workspace, and the reserve of each budget."""
    state = binding.state
    kinds = {
        "weights": held_bytes(binding.params),
        "kv_pages": held_bytes(state.kv),
        "gdn_slots": held_bytes(state.gdn),
        "workspace": workspace(binding),
    }
    lines = []
    for device in binding.placement.devices:
        budget = None if budgets is None else budgets.get(device.id)
        counts = {kind: held[device.id] for kind, held in kinds.items()}
        lines.append(DeviceMemory(device.id, budget, counts | {"reserve": reserve(budget)}))
    return tuple(lines)


def capacity(
    binding: Binding,
    placement: Placement,
    budgets: Mapping[int, int] | None,
    num_pages: int,
    page_size: int,
) -> Capacity:
    """The KV pages `placement` could hold within `budgets`, beside what the binding's weights
    and GDN slots would take there. The workspace is that of the placement's compiled
    programs, else the largest of the binding's own."""
    work = workspace(binding, placement)
    other = max(workspace(binding).values(), default=0)
    state = binding.state
    return pages_within(
        placement, binding.cfg, binding.params, state, num_pages, budgets, work, other, page_size
    )


def pages_within(
    placement: Placement,
    cfg: ModelConfig,
    params: Any,
    state: Any,
    num_pages: int,
    budgets: Mapping[int, int] | None,
    work: Mapping[int, int],
    other_work: int,
    page_size: int,
) -> Capacity:
    """The KV pages `placement` can hold within `budgets`: per device, what the budget leaves
    after the weights, the GDN slots, its workspace (`work` by device id, else `other_work`)
    and the reserve, over the bytes one page takes there (`state`, arrays or shapes, holds
    `num_pages`); the tightest device's count."""
    if budgets is None or any(d.id not in budgets for d in placement.devices):
        return Capacity(placement.name, None, None, None)
    weights = bytes_per_device(params, placement.param_shardings(params))
    shardings = placement.state_shardings(cfg)
    kv = bytes_per_device(state.kv, shardings.kv)
    gdn = bytes_per_device(state.gdn, shardings.gdn)
    best: Capacity | None = None
    for device in placement.devices:
        per_page = kv[device] // num_pages
        if per_page == 0:
            continue  # a stage without attention layers holds no pages
        budget = budgets[device.id]
        room = budget - weights[device] - gdn[device] - work.get(device.id, other_work)
        room -= reserve(budget)
        pages = max(0, room // per_page)
        if best is None or pages < (best.pages or 0):
            best = Capacity(placement.name, pages, pages * page_size, device.id)
    return best or Capacity(placement.name, None, None, None)


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
    need += bytes_per_device(state, placement.state_shardings(cfg))
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
) -> MemoryReport:
    """The ledger and the capacities (the live layout first) between two steps."""
    placements = [binding.placement]
    placements += [p for p in armed if p.key != binding.placement.key]
    capacities = tuple(capacity(binding, p, budgets, num_pages, page_size) for p in placements)
    return MemoryReport(binding.placement.name, account(binding, budgets), capacities)


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
