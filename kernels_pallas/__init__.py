"""The kernels under flipjax's model, one folder per operation, each kernel beside its pure-JAX
reference.

`paged_attention/`, `gdn/` and `matmul/` each hold every form of their operation: the reference,
the Pallas kernel, the native C++ source and its binding, as the operation has them. What serves
several operations stays here at the top: `dispatch` (the one place that chooses which form
runs), `native` (builds and loads every C++ source) with `parallel.h` (the parallel-for they
share), `head_parallel` (runs any kernel per device over its heads) and `check` (an entry point:
every kernel against its reference). Imports nothing from the rest of flipjax, except `check`.
"""
