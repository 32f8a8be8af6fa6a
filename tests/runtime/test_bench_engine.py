"""The engine benchmark's bounds count the parameters a decode step uses: transformers' own
parameter names (embedding, routed experts, the rest) are the oracle."""

from __future__ import annotations

import pytest
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from flipjax.benchmarks.engine import MOE_CONFIG, REFERENCE_CONFIG, active_parameters

SMALL = dict(hidden_size=64, num_hidden_layers=4, vocab_size=300, intermediate_size=96)
SMALL_SHAPES = dict(
    SMALL,
    layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=24,
)


def _counts(config: dict) -> tuple[int, int, int]:
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config))
    embed = experts = total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.endswith("embed_tokens.weight"):
            embed += p.numel()
        elif ".mlp.experts." in name:
            experts += p.numel()
    return total, embed, experts


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_moe_step_counts_the_experts_its_tokens_route_to(batch):
    config = dict(MOE_CONFIG, **SMALL_SHAPES, mlp_only_layers=[])
    total, embed, experts = _counts(config)
    assert experts > 0
    share = config["num_experts_per_tok"] / config["num_experts"]
    rest = total - embed - experts
    per_token = active_parameters(config, total, batch, per_token=True)
    assert per_token == pytest.approx(rest + share * experts)
    read = active_parameters(config, total, batch, per_token=False)
    assert read == pytest.approx(rest + (1 - (1 - share) ** batch) * experts)


def test_a_dense_step_counts_every_parameter_but_the_embedding():
    config = dict(REFERENCE_CONFIG, **SMALL_SHAPES, mlp_only_layers=[0, 1, 2, 3])
    total, embed, experts = _counts(config)
    assert experts == 0
    for per_token in (True, False):
        assert active_parameters(config, total, 8, per_token=per_token) == total - embed
