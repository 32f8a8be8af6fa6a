"""Benchmarks run by `python -m flipjax.bench`; each compares against a peer in the same run."""
