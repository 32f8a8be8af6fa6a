"""Parameter dtypes by name: the `--dtype` choices of every CLI and `Engine.from_pretrained`."""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)
