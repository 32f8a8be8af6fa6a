"""The grouped matmul of mixture-of-experts layers on the CPU: `ragged_matmul.cc` (the native
kernel, fp32 and bf16 weights) and `native_binding` (its Python side).

The reference is `jax.lax.ragged_dot`, which `kernels_pallas.dispatch.ragged_dot` runs wherever
the kernel does not. Nothing here imports from flipjax.
"""
