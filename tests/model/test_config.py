"""ModelConfig.from_hf: both rope spellings, the legacy layer interval, and named refusals."""

from __future__ import annotations

import copy

import pytest

from flipjax.model.config import ModelConfig

RAW = {
    "model_type": "qwen3_next",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "intermediate_size": 96,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}


def _raw(**changes):
    raw = copy.deepcopy(RAW)
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


def test_legacy_interval_and_top_level_rope():
    cfg = ModelConfig.from_hf(_raw(rope_theta=5e6, partial_rotary_factor=0.5))
    assert cfg.full_attention_layers == (3, 7)
    assert cfg.rope_theta == 5e6 and cfg.partial_rotary_factor == 0.5
    assert cfg.rotary_dim == 16


def test_nested_rope_parameters():
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    cfg = ModelConfig.from_hf(_raw(rope_parameters=rope, full_attention_interval=2))
    assert cfg.rope_theta == 1e6 and cfg.rotary_dim == 8
    assert cfg.full_attention_layers == (1, 3, 5, 7)


def test_moe_layer_rule():
    cfg = ModelConfig.from_hf(_raw())
    assert [cfg.is_moe_layer(i) for i in range(8)] == [
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        True,
    ]


def test_round_trip_through_dict():
    cfg = ModelConfig.from_hf(_raw())
    assert (
        ModelConfig(
            **{
                **cfg.to_dict(),
                "layer_types": cfg.layer_types,
                "mlp_only_layers": cfg.mlp_only_layers,
            }
        )
        == cfg
    )


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"linear_num_key_heads": 3}, "linear_num_key_heads"),
        ({"layer_types": ["linear_attention"] * 7 + ["sliding"]}, r"layer_types\[7\]"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": None}, "vocab_size"),
        ({"mlp_only_layers": [12]}, "mlp_only_layers"),
    ],
)
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(_raw(**changes))
