"""Small building blocks named as in the HF checkpoint, so weight loading is a rename.

`Linear.kernel` is `[in, out]`, the transpose of the checkpoint's `weight` (`nn.Linear`'s
`[out, in]`); the loader transposes once. XLA:CPU runs a small-batch `x @ kernel` with the
kernel `[in, out]` up to twice as fast as the same product against `[out, in]` (decode at batch
8: 253 -> 340 tok/s on the benchmark model). The two RMSNorm flavours differ on purpose:
the layer norms are zero-centred (`1 + w`), the GDN output norm is not (`w`). Both normalise in
fp32 because the checkpoints were trained that way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import ModelConfig
from kernels_pallas import dispatch
from kernels_pallas.matmul.token_rounding import round_tokens_to_int8
from kernels_pallas.matmul.xla_form import xla_matmul


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, std: float) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """Bias-free linear layer; kernel: [in, out] (the checkpoint's `weight`, transposed).

    Quantized (`flipjax.model.quantize`), the kernel is int8 with `scale` [out] beside it,
    `split` says which of its dimensions a TP layout splits ("out" or "in"), and a W8A8
    checkpoint's `int8_activations` rounds each token's input to int8 first."""

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        # Drawn as [out, in] and transposed, so a seed gives the weights it always gave.
        w = _normal(rngs, (out_features, in_features), dtype, 0.02)
        self.kernel = nnx.Param(w.T)
        self.scale: nnx.Param | None = nnx.data(None)
        self.split: str | None = None
        self.int8_activations = False  # W8A8: round each token's input to int8 first

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel[...]
        if self.scale is not None:
            if self.int8_activations:
                x = round_tokens_to_int8(x)
            return dispatch.quantized_matmul(x, w, self.scale[...], split=self.split or "out")
        num_rows = math.prod(x.shape[:-1])
        native = dispatch.matmul(num_rows, w.shape[1], w.dtype)
        if native is not None:  # a decode step's few rows (see `dispatch.matmul`)
            y = native(x.reshape(num_rows, -1).astype(jnp.float32), w)
            return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[1])
        return xla_matmul(x, w)


def project(x: jax.Array, *linears: Linear) -> tuple[jax.Array, ...]:
    """`linear(x)` for each of `linears`, which share x (a layer's projections): one call of
    the native kernel for them all where it takes their rows and columns together
    (`dispatch.matmuls`), so a decode step pays one dispatch and XLA runs no narrow dot beside
    it (a GDN layer's 24-column `in_proj_ba`); else each Linear in turn. Each product is the
    kernel's for that weight alone, bit for bit (a narrow one's: not XLA's dot, as alone)."""
    ws = [linear.kernel[...] for linear in linears]  # int8 ones (quantized) run each their own
    rows = math.prod(x.shape[:-1])
    if len({w.dtype for w in ws}) == 1:
        native = dispatch.matmuls(rows, [w.shape[1] for w in ws], ws[0].dtype)
        if native is not None:
            ys = native(x.reshape(rows, -1).astype(jnp.float32), ws)
            return tuple(y.astype(x.dtype).reshape(*x.shape[:-1], y.shape[1]) for y in ys)
    return tuple(linear(x) for linear in linears)


class Embedding(nnx.Module):
    """weight: [vocab, hidden]."""

    def __init__(self, vocab: int, hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (vocab, hidden), dtype, 0.02))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class RMSNormGated(nnx.Module):
    """GDN output norm: (w * norm(x)) * silu(z) over x, z [..., heads, dim]; not zero-centred.
    By a native kernel where `dispatch.gated_norm` gives one (the same products, in fp32)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        dtype = x.dtype
        kernel = dispatch.gated_norm(dtype, x.shape[-2], self.eps) if x.ndim >= 2 else None
        if kernel is not None and z.dtype == dtype and self.weight[...].dtype == dtype:
            return kernel(x, z, self.weight[...])
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * y.astype(dtype)
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)


def rotary_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [..., rotary_dim] for integer positions [...] (frequencies repeated twice)."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, head_dim]; cos/sin: [B, T, rot]. Rotates the first rot dims only."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
