"""The compiled step programs of this process, shared by every engine whose model, placement
and step shape match, so a second engine of the same kind compiles nothing.

Each program holds about twenty memory mappings of XLA:CPU's JIT code, and the kernel allows a
process `vm.max_map_count` of them (65530 by default); past that a compile fails. A process that
builds and drops many engines over its life (a test worker, a sweep) calls `release()`. It must
never drop what a live engine uses: an engine keeps its own references to its programs.
"""

from __future__ import annotations

from typing import Any

PROGRAMS: dict[tuple[Any, ...], Any] = {}


def release() -> int:
    """Forget every cached program, so those no live engine uses are freed; how many were."""
    held = len(PROGRAMS)
    PROGRAMS.clear()
    return held
