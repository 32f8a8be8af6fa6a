"""How much memory each device may give the engine: `--device-memory` (one size for every
device, or one per device in the layout's device order, e.g. `32GiB,10GiB,10GiB`), else on a
device that reports its memory (a GPU) its `bytes_limit` times `--mem-fraction-static`, as
sglang sizes its static memory (in one process only: each process can read only its own
devices, and every process must size the same pools). The CPU reports nothing, so there a
device has no budget unless one is given: budgets are how a CPU mesh models unequal devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

MAX_BUDGET = 2**50  # a petabyte: a size past it is a typo
_BYTE_SIZE = TypeAdapter(ByteSize)
# What a budget keeps free beside the state: room for a flip's transfers and allocator slack.
RESERVE_FRACTION = 0.05


class BudgetError(ValueError):
    """A budget that cannot be read, or that does not match the devices."""


def parse_size(text: str) -> int:
    """`32GiB`, `10G` (decimal), `512MiB`, `1.5GiB` or plain bytes, as bytes (pydantic's
    `ByteSize` reads the units)."""
    try:
        size = int(_BYTE_SIZE.validate_python(text.strip()))
    except ValidationError:
        raise BudgetError(
            f"device_memory: cannot read {text!r} as a size (e.g. 32GiB, 10GB, 512MiB, bytes)"
        ) from None
    if not 0 < size <= MAX_BUDGET:
        raise BudgetError(f"device_memory: {text!r} must be above 0 and at most 1 PiB")
    return size


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes (`parse_size`)."""
    return tuple(parse_size(part) for part in text.split(","))


def device_budgets(
    devices: Sequence[Any],
    device_memory: str | None,
    mem_fraction_static: float,
    process_count: int = 1,
) -> dict[int, int] | None:
    """Each device's budget in bytes, by device id; None where no device has one (the CPU
    without `--device-memory`). One size is every device's; a list names the devices in order
    (`jax.devices()`), and devices past its end have none."""
    if device_memory is not None:
        sizes = parse_sizes(device_memory)
        if len(sizes) == 1:
            sizes = sizes * len(devices)
        if len(sizes) > len(devices):
            raise BudgetError(
                f"device_memory: {len(sizes)} sizes for {len(devices)} devices; give one size "
                f"for all, or at most one per device"
            )
        return {d.id: size for d, size in zip(devices, sizes, strict=False)}
    if process_count > 1:
        # A process reads only its own devices' limits, and every process must size the same
        # pools: across processes only an explicit --device-memory is a budget.
        return None
    limits = {}
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits[d.id] = int(stats["bytes_limit"] * mem_fraction_static)
    return limits


def reserve(budget: int | None) -> int:
    """The share of `budget` the engine never fills (0 without a budget)."""
    return 0 if budget is None else int(budget * RESERVE_FRACTION)


def format_bytes(n: float) -> str:
    """1.5 GiB, 12.0 MiB, 512 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
