"""Pallas kernels, each beside its pure-JAX reference. Imports nothing from the rest of flipjax."""
