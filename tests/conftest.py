"""Test session setup: 8 virtual CPU devices, fp32 matmuls, shared fixtures.

XLA_FLAGS must be set before jax is first imported, which is why it happens at module import.
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

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
