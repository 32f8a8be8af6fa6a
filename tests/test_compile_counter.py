"""The compile counter counts every program an owner gets from XLA, the persistent cache's
included: the suite's no-recompilation checks run with that cache on (see conftest)."""

import jax
import jax.numpy as jnp

from flipjax.runtime.compile_counter import CompileCounter

_HITS = "/jax/compilation_cache/cache_hits"


def test_a_program_loaded_from_the_persistent_cache_counts_as_a_compilation():
    hits: list[str] = []  # jax has no public way to remove a listener: keep it to cache hits
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event == _HITS else None
    )

    def program(x):
        return jnp.sin(x) * 3.25 + 0.125  # constants no other test compiles

    x = jnp.arange(7.0)
    counter = CompileCounter()
    with counter.watch():
        jax.jit(program)(x).block_until_ready()
    assert counter.count == 1

    jax.clear_caches()  # the next call goes back to XLA, which finds it on disk
    hits.clear()
    with counter.watch():
        jax.jit(program)(x).block_until_ready()
    assert hits, "the second compilation did not come from the persistent cache"
    assert counter.count == 2
