"""Layer 2, the runtime: pools and their ledgers, cache state, placement, the binding, the step
programs and the sampler.

Imports only the model and the kernels below it; it never decides what to run, only runs it.
"""
