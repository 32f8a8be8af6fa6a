"""The gated products `silu(g) * x` and `x * sigmoid(g)` by the native CPU kernels (`gates.cc`,
beside this file). This module imports nothing from flipjax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import native

# The kernel of each gate's activation.
TARGETS = {"silu": "silu_mul", "sigmoid": "sigmoid_mul"}


def gate(activation: str, g: jax.Array, x: jax.Array, isa: str | None = None) -> jax.Array:
    """`silu(g) * x` (activation "silu") or `x * sigmoid(g)` ("sigmoid"), g and x float32 of one
    shape, by the kernel built for `isa` (see `native.ISAS`; default `native.build_isa()`)."""
    if activation not in TARGETS:
        raise ValueError(f"gate: activation {activation!r} is not one of {sorted(TARGETS)}")
    if g.shape != x.shape or g.dtype != jnp.float32 or x.dtype != jnp.float32:
        raise ValueError(
            f"gate: g and x must be float32 of one shape, got {g.dtype}{list(g.shape)} and "
            f"{x.dtype}{list(x.shape)}"
        )
    target = native.target(TARGETS[activation], isa)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, jnp.float32))(g, x)
