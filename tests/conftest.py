"""Test session setup: 8 virtual CPU devices, fp32 matmuls, one compilation cache, shared fixtures.

XLA_FLAGS must be set before jax is first imported, which is why it happens at module import.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    # Tests compile many small programs and run each a few times: cheaper compiles win (-25%).
    + " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Many tests, their pytest workers and the servers and processes they start compile the same
# tiny-model programs. One persistent cache for the run compiles each once (-14% on the suite);
# a cache load still counts as a compilation for the engines' counters. The first process to get
# here (pytest's controller) makes the folder and removes it at exit; the rest inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="flipjax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
