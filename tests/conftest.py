"""Test session setup: 8 virtual CPU devices, fp32 matmuls, no persistent compilation cache.

XLA_FLAGS must be set before jax is first imported, which is why it happens at module import.

The suite once shared one persistent compilation cache among its workers and the servers they
start. Each cache write serializes the program, and a serialization that failed threw a C++
exception whose unwinding faulted, which hung a worker (see `test_fault_handlers.py`). Without
the cache the suite took no longer (see the README's Tests section), so no process here writes
one; `test_compile_counter.py` checks the cache's accounting in a process of its own.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    # Tests compile many small programs and run each a few times: cheaper compiles win (-25%).
    + " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A cache named by the caller's environment would reach every server a test starts.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
