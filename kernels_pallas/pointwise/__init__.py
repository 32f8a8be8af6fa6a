"""Pointwise products around the model's gates: `gates.cc` (the native CPU kernels) and
`native_binding` (their Python side). `kernels_pallas.dispatch.gate` chooses them where they run;
elsewhere the model's own XLA form runs. Nothing here imports from flipjax.
"""
