"""Parameter dtypes by name: the `--dtype` choices of every CLI and `Engine.from_pretrained`."""

from __future__ import annotations

import jax.numpy as jnp

from flipjax.model.config import DTYPE_NAMES

DTYPES = {name: jnp.dtype(name) for name in DTYPE_NAMES}


def parse_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)
