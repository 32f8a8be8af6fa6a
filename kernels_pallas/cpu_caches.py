"""How many bytes a timed sweep must span so that it reads memory, not this CPU's caches.

A decode step reads each weight once, from memory. A measurement that cycles over fewer bytes
than the last-level cache times the cache instead: on a CPU with a 260 MB L3, a 48 MB sweep
ran XLA's one-row product at 49 GB/s and the streaming kernel at 42, where from memory the
kernel read at 27 GB/s and XLA at 23, so a choice made from the cached times picked the
slower product for every decode step (`python -m flipjax.bench matmul`). The calibration of
the native matmul and the benchmarks' bounds therefore size their sweeps from the cache this
CPU reports. This module imports nothing from flipjax.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
FALLBACK_BYTES = 64 << 20  # where the cache cannot be read: more than most CPUs' L3
MIN_SWEEP_BYTES = 48 << 20
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@functools.cache
def last_level_cache_bytes(caches: Path = CACHES) -> int:
    """The size of the largest cache CPU 0 reports (sysfs), or `FALLBACK_BYTES` if none can be
    read."""
    sizes = []
    for index in sorted(caches.glob("index*")):
        try:
            sizes.append(parse_size((index / "size").read_text()))
        except (OSError, ValueError):
            continue
    return max(sizes, default=FALLBACK_BYTES)


def parse_size(text: str) -> int:
    """`48K`, `2048K`, `266240K`, `32M` (sysfs's spelling) as bytes; ValueError otherwise."""
    text = text.strip()
    scale = UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if text[-1:].upper() in UNITS else text
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"not a cache size: {text!r}")
    return int(digits) * scale


def sweep_bytes(floor: int = MIN_SWEEP_BYTES) -> int:
    """Bytes a sweep of distinct buffers must span so that none is still cached when the sweep
    comes back to it: twice the last-level cache (its replacement is not exactly LRU), and at
    least `floor`."""
    return max(floor, 2 * last_level_cache_bytes())


def uncached_copies(weight: jax.Array, span: int | None = None) -> list[jax.Array]:
    """`weight` and copies of it in buffers of their own, at least two, together spanning
    `span` bytes (default `sweep_bytes()`). Copied on the device: drawing hundreds of
    megabytes of random numbers for each would take longer than the timing."""
    copies = max(2, -(-(span or sweep_bytes()) // weight.nbytes))
    return [weight] + [jnp.array(weight, copy=True) for _ in range(copies - 1)]
