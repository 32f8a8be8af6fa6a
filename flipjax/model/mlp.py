"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a gated shared expert.

The MoE sends each token only to its chosen experts: assignments are sorted by expert and run as
one grouped matmul (`kernels_pallas.dispatch.ragged_dot`), so cost scales with top-k, not with
the expert count. Each token's expert outputs are gathered back and summed in the order of its
choices, so a token's result does not depend on the others in its batch. Expert weights are
stacked `[experts, in, out]` (the loader transposes the checkpoint's per-expert `[out, in]`
once) because that is the operand shape the grouped matmul takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.layers import Linear, project
from kernels_pallas import dispatch
from kernels_pallas.matmul.token_rounding import round_tokens_to_int8


class Qwen3NextMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(*project(x, self.gate_proj, self.up_proj))

    def down(self, g: jax.Array, up: jax.Array) -> jax.Array:
        """The MLP's output from its gate and up projections of x."""
        kernel = dispatch.gate("silu", g.dtype) if up.dtype == g.dtype else None
        return self.down_proj(kernel(g, up) if kernel else jax.nn.silu(g) * up)


class Qwen3NextExperts(nnx.Module):
    """gate_proj, up_proj: [E, hidden, moe_inter]; down_proj: [E, moe_inter, hidden]. Quantized
    (`flipjax.model.quantize`), each is int8 with `<name>_scale` [E, out] beside it."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def init(shape: tuple[int, ...]) -> nnx.Param:
            w = jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02
            return nnx.Param(w.astype(dtype))

        self.gate_proj = init((e, h, i))
        self.up_proj = init((e, h, i))
        self.down_proj = init((e, i, h))
        self.gate_proj_scale: nnx.Param | None = nnx.data(None)
        self.up_proj_scale: nnx.Param | None = nnx.data(None)
        self.down_proj_scale: nnx.Param | None = nnx.data(None)
        self.int8_activations = False  # W8A8: round each token's input to int8 first

    def __call__(self, x: jax.Array, top_idx: jax.Array, top_w: jax.Array) -> jax.Array:
        """x: [N, H]; top_idx, top_w: [N, k]. Returns sum_k w * expert_k(x): [N, H]."""
        n, k = top_idx.shape
        num_experts = self.gate_proj.shape[0]
        flat_expert = top_idx.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        xs = x[order // k]
        h_gate = self._project("gate_proj", xs, group_sizes, "out")
        h_up = self._project("up_proj", xs, group_sizes, "out")
        act = jax.nn.silu(h_gate) * h_up
        y = self._project("down_proj", act, group_sizes, "in")
        # Back to (token, choice) order: a gather, where a scatter-add would sum in any order.
        y = y[jnp.argsort(order)].reshape(n, k, -1)
        return jnp.sum(y * top_w[..., None].astype(y.dtype), axis=1)

    def _project(self, name: str, x: jax.Array, group_sizes: jax.Array, split: str) -> jax.Array:
        scale = getattr(self, f"{name}_scale")
        scale = None if scale is None else scale[...]
        if scale is not None and self.int8_activations:
            x = round_tokens_to_int8(x)
        return dispatch.ragged_dot(
            x, getattr(self, name)[...], group_sizes, split=split, scale=scale
        )


class Qwen3NextSparseMoeBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, dtype=dtype, rngs=rngs)
        self.experts = Qwen3NextExperts(cfg, dtype=dtype, rngs=rngs)
        self.shared_expert = Qwen3NextMLP(
            cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype=dtype, rngs=rngs
        )
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shared = self.shared_expert
        # Everything that reads x, in one call where the native kernel takes it.
        logits, g, up, shared_gate = project(
            x, self.gate, shared.gate_proj, shared.up_proj, self.shared_expert_gate
        )
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top_w, top_idx = jax.lax.top_k(probs, self.cfg.num_experts_per_tok)
        if self.cfg.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        routed = self.experts(x, top_idx, top_w.astype(x.dtype))
        return (routed + jax.nn.sigmoid(shared_gate) * shared.down(g, up)).reshape(shape)
