"""Tiny Qwen3-Next checkpoints quantized by compressed-tensors' own tools, as llm-compressor
writes them: per-output-channel symmetric int8 weights (scales from the library's own
`calculate_qparams`), W8A16 or W8A8, in the library's `int-quantized` or `pack-quantized`
format, with the head, router, gates and GDN `in_proj_ba` left unquantized."""

from __future__ import annotations

import os
from typing import Any

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from tests.support.hf_oracle import make_checkpoint

CHANNEL_INT8 = dict(num_bits=8, type="int", strategy="channel", symmetric=True)
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_ba$"]


def int8_checkpoint(
    folder: str,
    fmt: str,
    activations: bool,
    seed: int = 3,
    weights: dict[str, Any] | None = None,
    **config: Any,
) -> None:
    """Save a random model to `folder`, quantized (`weights` overrides the weight scheme)."""
    hf = make_checkpoint(folder, seed=seed, **config)
    w = QuantizationArgs(**{**CHANNEL_INT8, **(weights or {})})
    a = None
    if activations:
        a = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=w, input_activations=a)
    apply_quantization_config(
        hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE)
    )
    with torch.no_grad():
        for module in hf.modules():
            if hasattr(module, "weight_scale"):
                # One range per output channel, or per group of a channel's inputs.
                rows = module.weight.reshape(*module.weight_scale.shape, -1)
                lo, hi = rows.amin(dim=-1), rows.amax(dim=-1)
                scale, zero = calculate_qparams(lo, hi, w)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    hf.save_pretrained(folder)
    compressor.update_config(folder)


def quantize_experts(folder: str) -> None:
    """Store every routed expert's projections int8 too (`int-quantized`: values and a
    channel-wise scale, by compressed-tensors' own `quantize`), as llm-compressor writes the
    per-expert linear layers of a mixture-of-experts checkpoint."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    args = QuantizationArgs(**CHANNEL_INT8)
    for name in [n for n in tensors if ".mlp.experts." in n and n.endswith(".weight")]:
        w = tensors[name]
        scale, zero = calculate_qparams(
            w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args
        )
        tensors[name] = quantize(w, scale, zero, args, dtype=torch.int8)
        tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
    save_file(tensors, path, metadata={"format": "pt"})


def dequantized(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `folder`, int8 ones times their scales (the weights
    a checkpoint stored int8 stands for), by their names in the files."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    args = QuantizationArgs(**CHANNEL_INT8)
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        out[name] = dequantize(t, scale, args=args) if scale is not None else t
    return out
