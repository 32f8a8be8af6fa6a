"""ModelConfig: the one typed description of a Qwen3-Next model that every part receives.

Built from a HF `config.json` (`model_type: qwen3_next`). Validation lives here so that a bad
config fails at load time with the offending field named, never deep inside a traced function.
This module must not import jax: the store and the CLIs read configs without touching a device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from flipjax.model.checkpoint_quantization import stored_int8

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)

# The parameter dtypes flipjax runs (`flipjax.model.dtypes` maps them to jax's; named here,
# where reading them needs no jax).
DTYPE_NAMES = ("float32", "bfloat16")
# `--quantization`: what `flipjax.model.quantize` does to the weights at load.
QUANTIZATIONS = ("int8",)
# `--kv-cache-dtype` (vLLM's names) -> the KV pages' dtype by name; None: the model's own.
# 'fp8' is vLLM's alias of the e4m3 format.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "int8": "int8",
}


def interleaved_layer_types(layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3-Next's pattern: layer i is full attention when (i + 1) % interval == 0."""
    return tuple(
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
    )


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATIONS:
        raise ValueError(
            f"quantization: {method!r} is not supported; use one of {QUANTIZATIONS} "
            "(or none for the checkpoint's own dtype)"
        )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: int | None = None
    # Decoder layers of the multi-token-prediction head (`mtp.*`); 0: the checkpoint has none.
    mtp_num_hidden_layers: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    # Derived sizes, named as in the reference implementation.
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> ModelConfig:
        """Build from a HF checkpoint folder, a `config.json` path, or its parsed dict."""
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                raw = json.load(f)
        return cls(**_fields_from_hf(raw))


def _fields_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type != "qwen3_next":
        raise ValueError(f"model_type: expected 'qwen3_next', got {model_type!r}")
    stored_int8(raw)  # refuses a stored quantization flipjax does not load
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if name not in raw:
            raise ValueError(f"{name}: required field missing from config")

    n_layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = int(raw.get("full_attention_interval", 4))
        if interval <= 0:
            raise ValueError(f"full_attention_interval: must be positive, got {interval}")
        layer_types = interleaved_layer_types(n_layers, interval)

    rope_theta, partial = _rope_fields(raw)
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=n_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
        head_dim=int(head_dim),
        linear_num_key_heads=int(raw.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(raw.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(raw.get("intermediate_size", 0)),
        partial_rotary_factor=partial,
        rope_theta=rope_theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        num_experts=int(raw.get("num_experts", 0)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        eos_token_id=None if eos is None else int(eos),
        # Published Qwen3-Next configs name it `mtp_num_hidden_layers`; vLLM reads the
        # DeepSeek name `num_nextn_predict_layers`.
        mtp_num_hidden_layers=int(
            raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 0)) or 0
        ),
    )


def _rope_fields(raw: dict[str, Any]) -> tuple[float, float]:
    """Accept top-level rope fields (published checkpoints) and nested `rope_parameters`."""
    nested = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = nested.get("rope_type", nested.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')"
        )
    theta = nested.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = nested.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    return float(theta), float(partial)


def _validate(c: ModelConfig) -> None:
    # A table of field names, kept packed (fmt: skip): one name a line would run 15 lines.
    positive = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
        "decoder_sparse_step", "max_position_embeddings",
    )  # fmt: skip
    for name in positive:
        value = getattr(c, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    mtp_layers = c.mtp_num_hidden_layers
    if not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ValueError(f"mtp_num_hidden_layers: must be an integer >= 0, got {mtp_layers!r}")
    if len(c.layer_types) != c.num_hidden_layers:
        raise ValueError(
            f"layer_types: has {len(c.layer_types)} entries, num_hidden_layers is "
            f"{c.num_hidden_layers}"
        )
    for i, t in enumerate(c.layer_types):
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}]: unknown layer type {t!r}, expected {LAYER_TYPES}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads: {c.num_key_value_heads} does not divide "
            f"num_attention_heads {c.num_attention_heads}"
        )
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ValueError(
            f"linear_num_key_heads: {c.linear_num_key_heads} does not divide "
            f"linear_num_value_heads {c.linear_num_value_heads}"
        )
    if not 0.0 < c.partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {c.partial_rotary_factor}")
    if c.rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor: head_dim * factor = {c.rotary_dim} must be even")
    for i in c.mlp_only_layers:
        if not 0 <= i < c.num_hidden_layers:
            raise ValueError(f"mlp_only_layers: layer {i} is out of range")
    any_moe = any(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    any_dense = not all(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    if any_moe:
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={c.num_experts}], "
                f"got {c.num_experts_per_tok}"
            )
        if c.moe_intermediate_size <= 0:
            raise ValueError("moe_intermediate_size: must be positive when experts are used")
    if any_dense and c.intermediate_size <= 0:
        raise ValueError("intermediate_size: must be positive for dense MLP layers")
