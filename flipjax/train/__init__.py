"""Training with the engine's own modules: `python -m flipjax.train` (see `cli`)."""
