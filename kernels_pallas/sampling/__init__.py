"""Choosing a row's token from its logits: `reference` (pure JAX, the oracle and what runs where
no kernel does), `first_max.cc` (the native CPU kernel) and `native_binding` (its Python side).
`kernels_pallas.dispatch.first_max` chooses between them. Nothing here imports from flipjax.
"""
