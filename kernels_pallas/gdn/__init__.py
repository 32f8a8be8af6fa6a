"""The gated delta rule of the Gated DeltaNet layers, in every form it runs.

`reference` (pure JAX: the recurrent and the chunkwise WY/UT form, the oracle of the others and
what runs where no kernel does), `pallas_kernel` (the chunked prefill and one-step decode Pallas
kernels), `gdn_decode.cc` (the native CPU decode update over pooled states, in place) and
`native_binding` (its Python side). `kernels_pallas.dispatch` chooses among them. Nothing here
imports from flipjax.
"""
