"""Builds tiny random Qwen3-Next checkpoints with transformers, our correctness oracle."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

torch.set_num_threads(2)

BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    intermediate_size=96,
    num_experts=0,
    mlp_only_layers=[0, 1, 2, 3],
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {},
    "moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
    "grouped_v": dict(linear_num_key_heads=1, linear_num_value_heads=4, num_key_value_heads=1),
}


def make_checkpoint(folder: str, seed: int = 0, **overrides: Any) -> Qwen3NextForCausalLM:
    """Save a perturbed random model to `folder` and return it (eval mode, fp32)."""
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**{**BASE, **overrides})
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        # Random init leaves norms at 0 and 1, which would hide a norm bug.
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.08)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True, **overrides.pop("_save", {}))
    return model
