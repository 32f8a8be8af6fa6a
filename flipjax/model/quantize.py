"""Weight-only int8 quantization at load (W8A16): `--quantization int8`.

Each quantized weight becomes int8 with one fp32 scale per output channel (symmetric: the scale
is the channel's largest magnitude over 127, and zero maps to zero), as vLLM's and
llm-compressor's channel-wise int8 schemes store it. Activations stay in the model's dtype; the
product is `(x @ q) * scale`, with q widened exactly inside the matmul (`Linear`,
`kernels_pallas.dispatch.quantized_matmul`), so no dequantized copy of a weight is kept.

What is quantized: the attention projections, the GDN input (`in_proj_qkvz`) and output
projections, the dense MLP, the shared expert and the routed experts: all but a fraction of a
percent of a layer's weights. What is not, and why:
- the embedding and the lm head, which vLLM and llm-compressor also keep: the head's rounding
  lands directly on the logits;
- the MoE router (`mlp.gate`) and the shared expert's gate: tiny, and their outputs choose
  experts and gate the shared expert, so a rounding there changes which weights run;
- the GDN's `in_proj_ba`: tiny ([hidden, 2 x value heads]), and it sets the recurrence's decay
  and write strength, whose errors compound across every later token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from flax import nnx

from flipjax.model.config import check_quantization
from flipjax.model.layers import Linear
from flipjax.model.mlp import Qwen3NextExperts
from flipjax.model.mtp import Qwen3NextMTP
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.scale_names import scale_name

INT8_MAX = 127
M = TypeVar("M", bound=nnx.Module)
# The projections that are quantized, and what a TP layout splits of each: its output columns
# ("out", column-parallel) or its input rows ("in", row-parallel, the partial products summed).
SPLITS = {
    "q_proj": "out",
    "k_proj": "out",
    "v_proj": "out",
    "o_proj": "in",
    "in_proj_qkvz": "out",
    "out_proj": "in",
    "gate_proj": "out",
    "up_proj": "out",
    "down_proj": "in",
}
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_BLOCK_ELEMENTS = 1 << 18  # a quantizing block: 1 MiB of fp32


def quantize_int8(w: np.ndarray | jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """w [..., in, out] -> (q int8 [..., in, out], scale float32 [..., out]), per output
    channel: w ~= q * scale. Quantized on the host, where the loader leaves the weights, a
    block of input rows at a time: the fp32 temporaries of a whole weight, several times its
    int8 size, would otherwise be what a load's peak memory holds beyond the weights."""
    if isinstance(w, jax.Array) and not w.is_fully_addressable:
        raise ValueError(
            "quantization: a weight restored across processes cannot be quantized on this "
            "host; serve the HF checkpoint folder (each process reads and quantizes it whole) "
            "or a checkpoint stored int8"
        )
    w = np.asarray(w)
    *lead, rows, cols = w.shape
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    blocks = [(i, slice(r, r + step)) for i in np.ndindex(*lead) for r in range(0, rows, step)]
    peak = np.zeros((*lead, cols), np.float32)
    for i, r in blocks:
        np.maximum(peak[i], np.max(np.abs(w[i][r].astype(np.float32)), axis=0), out=peak[i])
    scale = np.where(peak > 0, peak / INT8_MAX, 1.0).astype(np.float32)
    q = np.empty(w.shape, np.int8)
    for i, r in blocks:
        block = np.rint(w[i][r].astype(np.float32) / scale[i])
        q[i][r] = np.clip(block, -INT8_MAX, INT8_MAX)
    return q, scale


def weight_quantizer(
    method: str | None,
) -> Callable[[str, np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None:
    """For the loader, which quantizes each weight as it reads it (the model's weights are
    never all held in float at once): `(parameter name, weight in the model's dtype) ->
    (int8, scale)` for exactly the weights `quantize_model` quantizes, None for the others.
    None without a method."""
    check_quantization(method)
    if method is None:
        return None

    def quantize(name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        *_, owner, leaf = ["", *name.split(".")]
        linear = leaf == "kernel" and owner in SPLITS
        experts = owner == "experts" and leaf in EXPERT_PROJECTIONS
        return quantize_int8(w) if linear or experts else None

    return quantize


def quantize_model(model: Qwen3NextForCausalLM, method: str | None) -> Qwen3NextForCausalLM:
    """A model whose weights are `method`'s (None: `model` itself). `model` is left as it was:
    the result is a new module sharing the weights that are not quantized."""
    return _quantized(model, method, SPLITS)


def quantize_draft_head(head: Qwen3NextMTP, method: str | None) -> Qwen3NextMTP:
    """The MTP head a speculating engine drafts with, its weights `method`'s: those
    `quantize_model` quantizes in a layer, and its input projection `fc` too (None: `head`
    itself). Its drafts only propose, so their rounding costs acceptance, never a token."""
    return _quantized(head, method, {**SPLITS, "fc": "out"})


def _quantized(model: M, method: str | None, splits: dict[str, str]) -> M:
    check_quantization(method)
    if method is None:
        return model
    # Weights a checkpoint stored int8 keep their own scales; only the others are quantized.
    out = nnx.merge(*nnx.split(model))
    for path, module in nnx.iter_modules(out):
        name = str(path[-1]) if path else ""
        if isinstance(module, Linear) and name in splits and module.scale is None:
            q, scale = quantize_int8(module.kernel[...])
            module.kernel = nnx.Param(q)
            module.scale = nnx.Param(scale)
            module.split = splits[name]
        elif isinstance(module, Qwen3NextExperts):
            for proj in EXPERT_PROJECTIONS:
                if getattr(module, f"{proj}_scale") is not None:
                    continue
                q, scale = quantize_int8(getattr(module, proj)[...])
                setattr(module, proj, nnx.Param(q))
                setattr(module, f"{proj}_scale", nnx.Param(scale))
    return out


def attach_scales(
    model: Qwen3NextForCausalLM, scales: dict[str, np.ndarray], activations: bool = False
) -> None:
    """Give the weights a checkpoint stored int8 (loaded as int8 kernels) their scales, by the
    names `scale_names.scale_name` gives them; every scale must find its weight. With
    `activations` (W8A8), each token's input to those weights is rounded to int8 first."""
    left = dict(scales)
    for path, module in nnx.iter_modules(model):
        prefix = ".".join(map(str, path))
        if isinstance(module, Linear) and scale_name(f"{prefix}.kernel") in left:
            module.scale = nnx.Param(left.pop(scale_name(f"{prefix}.kernel")))
            module.split = SPLITS.get(str(path[-1]), "out")
            module.int8_activations = activations
        elif isinstance(module, Qwen3NextExperts):
            for proj in EXPERT_PROJECTIONS:
                if scale_name(f"{prefix}.{proj}") in left:
                    scale = nnx.Param(left.pop(scale_name(f"{prefix}.{proj}")))
                    setattr(module, f"{proj}_scale", scale)
                    module.int8_activations = activations
    if left:
        raise ValueError(f"int8 scales without a weight: {', '.join(sorted(left))}")
