"""Dropping a process's compiled programs gives back their memory mappings.

A process may hold vm.max_map_count mappings (65530 by default), and each XLA:CPU program holds
about twenty: a test worker that kept every engine's programs reached the limit, and the compile
that failed there crashed it. `program_cache.release()` is how such a process gives them back.
"""

from __future__ import annotations

import gc

import jax

from flipjax import Engine
from flipjax.runtime import program_cache


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_released_programs_give_back_their_memory_mappings():
    program_cache.release()
    jax.clear_caches()
    gc.collect()
    before = _mappings()
    engine = Engine.from_pretrained("tiny", max_running_requests=2, max_prefill_tokens=16)
    tokens = engine.generate([[1, 2, 3]], max_new_tokens=3)[0].token_ids
    held = _mappings() - before
    assert held > 500, f"an engine's programs held only {held} mappings"
    del engine
    gc.collect()
    assert _mappings() - before > held // 2, "the cache alone keeps the programs alive"
    assert program_cache.release() > 0
    jax.clear_caches()
    gc.collect()
    assert _mappings() - before < held // 4
    again = Engine.from_pretrained("tiny", max_running_requests=2, max_prefill_tokens=16)
    assert again.generate([[1, 2, 3]], max_new_tokens=3)[0].token_ids == tokens
