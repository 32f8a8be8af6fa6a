"""Layer 4, the engine: the `Engine` facade, the scheduler, the device prefix cache, prefix
reuse, sessions and the phase pilot.

It may use every layer below (`sharding`, `store`, `flipjax.runtime`, `flipjax.model`) and is
used only by `serve` and the entry points.
"""
