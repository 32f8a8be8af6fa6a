"""The compile counter counts every program an owner gets from XLA, the persistent cache's
included: a server run with `JAX_COMPILATION_CACHE_DIR` must not see its no-recompilation
checks pass on cache loads. The suite runs without that cache, so this runs in a process with
one of its own."""

import os
import subprocess
import sys

_PROGRAM = """
import jax, jax.numpy as jnp
from flipjax.runtime.compile_counter import CompileCounter

hits = []  # jax has no public way to remove a listener: keep it to cache hits
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None
)

def program(x):
    return jnp.sin(x) * 3.25 + 0.125

x = jnp.arange(7.0)
counter = CompileCounter()
with counter.watch():
    jax.jit(program)(x).block_until_ready()
assert counter.count == 1, counter.count

jax.clear_caches()  # the next call goes back to XLA, which finds it on disk
hits.clear()
with counter.watch():
    jax.jit(program)(x).block_until_ready()
assert hits, "the second compilation did not come from the persistent cache"
assert counter.count == 2, counter.count
print("counted", counter.count)
"""


def test_a_program_loaded_from_the_persistent_cache_counts_as_a_compilation(tmp_path):
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "counted 2" in done.stdout
    assert any((tmp_path / "xla-cache").iterdir())
