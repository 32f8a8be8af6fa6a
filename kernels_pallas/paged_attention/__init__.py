"""Paged attention: one call for decode rows and prefill chunks over K/V kept in pages.

Layout (one full-attention layer): `k_pages, v_pages: [pages, page_size, kv_heads, head_dim]`.
A request's tokens live in the pages its page table lists, token at position p in page
`page_table[p // page_size]` at offset `p % page_size`. Batches are rows of query tokens with
their positions; position -1 marks padding. A row may be a decode step (1 real token) or a
prefill chunk continuing earlier pages; the causal mask is by position, so both are the same
call.

The folder holds every form of the one operation: `reference` (pure JAX, the oracle and what
runs where no kernel does, with the unpaged `masked_attention`), `pages` (writing new K/V into
the pages), `pallas_kernel` (the ragged Pallas kernel), `paged_decode.cc` (the native CPU
decode kernel) and `native_binding` (its Python side). `kernels_pallas.dispatch` chooses among
them. Nothing here imports from flipjax.
"""
