"""Loading what an engine serves: the embedded tiny model, a HF checkpoint folder, or an orbax
folder written by `python -m flipjax.ckpt convert`, into host memory (across processes, an
orbax folder is restored straight into the layout's shardings, each device reading only its
shards)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.model.checkpoint_quantization import stored_int8_of
from flipjax.model.config import ModelConfig
from flipjax.model.dtypes import parse_dtype
from flipjax.model.orbax_io import abstract_params, is_orbax, restore_params
from flipjax.model.quantize import attach_scales, weight_quantizer
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.shipped import resolve
from flipjax.model.tiny import TINY_NAME, TINY_SEED, tiny_model
from flipjax.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from flipjax.model.weights import load_params
from sharding.auto_layout import AUTO
from sharding.layout import placement_for
from store.keys import files_fingerprint


@dataclass(frozen=True)
class Loaded:
    model: Qwen3NextForCausalLM
    tokenizer: Tokenizer
    name: str  # what the server calls the model: "tiny" or the folder's name


def load(
    path: str, dtype: jnp.dtype | str, layout: str | None = None, quantization: str | None = None
) -> Loaded:
    """The model, its tokenizer and its name. An orbax folder restores into `layout`'s
    shardings (a layout the model cannot take is refused before anything is read). A HF
    folder's weights are quantized by `quantization` as they are read (the others, by
    `quantize.quantize_model` at assembly)."""
    dtype = parse_dtype(dtype)
    if path == TINY_NAME:
        return Loaded(tiny_model(dtype), ByteTokenizer(), TINY_NAME)
    name, path = path, resolve(path)
    if not os.path.isdir(path):
        raise ValueError(f"model: {path!r} is neither a checkpoint folder nor {TINY_NAME!r}")
    cfg = ModelConfig.from_hf(path)
    graphdef, abstract = abstract_params(cfg, dtype)
    # Weights are read into host memory and placed from there shard by shard, so no device
    # ever holds more than its share; across processes each reads only its own shards.
    scales: dict[str, np.ndarray] = {}  # of weights the checkpoint stores int8
    quantized: dict[str, np.ndarray] = {}  # of weights `quantization` quantizes as they are read
    if is_orbax(path):
        placement = placement_for(layout, cfg) if layout not in (None, AUTO) else None
        shardings = None
        if placement is not None and jax.process_count() > 1:
            shardings = placement.param_shardings(abstract)
        params = restore_params(path, cfg, abstract, shardings)
    else:
        quantize = weight_quantizer(quantization)
        params = load_params(
            path, cfg, abstract, dtype, False, scales=scales, quantize=quantize, quantized=quantized
        )
    model = nnx.merge(graphdef, params)
    stored = None if is_orbax(path) else stored_int8_of(path)
    # Weights the checkpoint stores int8 stay int8 (W8A8: with its activation rounding).
    attach_scales(model, scales, activations=stored is not None and stored.activations)
    attach_scales(model, quantized)
    tokenizer = load_tokenizer(path, cfg.eos_token_id)
    return Loaded(model, tokenizer, os.path.basename(os.path.normpath(name)))


def model_fingerprint(path: str) -> str:
    """What identifies the weights `path` names, the same on every machine (the processes of a
    cluster must agree on it)."""
    if path == TINY_NAME:
        return f"{TINY_NAME}-seed-{TINY_SEED}"
    return files_fingerprint(resolve(path))
