"""The small-batch matmul of decode steps on the CPU: `matmul.cc` (the native kernel, fp32 and
bf16 weights) and `native_binding` (its Python side).

There is no reference module: where `kernels_pallas.dispatch.matmul` offers no kernel, the
model's `Linear` multiplies with XLA's own dot. Nothing here imports from flipjax.
"""
