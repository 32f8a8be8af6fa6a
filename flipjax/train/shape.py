"""The model a run trains: the default shape (the embedded model's), or a `config.json` given
with `--config`, fitted to the run's tokenizer and checked against the run before any step."""

from __future__ import annotations

import dataclasses

from flipjax.model.config import ModelConfig, interleaved_layer_types

DEFAULT_LAYERS = 8


def default_config(vocab_size: int, eos_token_id: int) -> ModelConfig:
    """Eight layers, every fourth full attention as in Qwen3-Next, dense MLPs, tied embeddings,
    and one MTP layer: the MTP layer is about a tenth of the model's compute."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=DEFAULT_LAYERS,
        layer_types=interleaved_layer_types(DEFAULT_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        intermediate_size=768,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_id=eos_token_id,
        mtp_num_hidden_layers=1,
    )


def fitted(cfg: ModelConfig, vocab_size: int, eos_token_id: int, seq_len: int) -> ModelConfig:
    """`cfg` checked against the run: its vocabulary must hold the tokenizer's, its positions
    the sequence length, and it must have the MTP layer the loss trains."""
    if cfg.vocab_size < vocab_size:
        raise ValueError(
            f"--config: vocab_size {cfg.vocab_size} is smaller than the tokenizer's {vocab_size}"
        )
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--seq-len: {seq_len} is past the config's max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    if cfg.mtp_num_hidden_layers < 1:
        raise ValueError("--config: mtp_num_hidden_layers must be at least 1 (the MTP loss)")
    return dataclasses.replace(cfg, eos_token_id=eos_token_id)
