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
from flipjax.model.mtp import Qwen3NextMTP
from flipjax.model.orbax_io import abstract_params, is_orbax, restore_params
from flipjax.model.quantize import attach_scales, weight_quantizer
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.shipped import resolve
from flipjax.model.tiny import TINY_NAME, TINY_SEED, tiny_model
from flipjax.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from flipjax.model.weights import load_params, tensor_files
from sharding.auto_layout import AUTO
from sharding.layout import placement_for
from store.keys import files_fingerprint


@dataclass(frozen=True)
class Loaded:
    model: Qwen3NextForCausalLM
    tokenizer: Tokenizer
    name: str  # what the server calls the model: "tiny" or the folder's name
    draft_head: Qwen3NextMTP | None = None  # the checkpoint's MTP head, when asked for


class _HeadOnly(nnx.Module):
    """The MTP head under its checkpoint name (`mtp.*`), to load it alone."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.mtp = Qwen3NextMTP(cfg, dtype=dtype, rngs=nnx.Rngs(0))


def load(
    path: str,
    dtype: jnp.dtype | str,
    layout: str | None = None,
    quantization: str | None = None,
    draft_head: bool = False,
) -> Loaded:
    """The model, its tokenizer and its name. An orbax folder restores into `layout`'s
    shardings (a layout the model cannot take is refused before anything is read). A HF
    folder's weights are quantized by `quantization` as they are read (the others, by
    `quantize.quantize_model` at assembly). `draft_head`: also its MTP head (in `dtype`:
    assembly quantizes it as the speculative config says), refused by name where the
    checkpoint has none."""
    dtype = parse_dtype(dtype)
    if draft_head and (path == TINY_NAME or is_orbax(resolve(path))):
        raise ValueError(
            f"speculative decoding: {path!r} has no MTP head to draft with (a checkpoint "
            f"folder with mtp.* tensors has one)"
        )
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
    head = _load_head(path, cfg, dtype) if draft_head else None
    return Loaded(model, tokenizer, os.path.basename(os.path.normpath(name)), head)


def _load_head(path: str, cfg: ModelConfig, dtype: jnp.dtype) -> Qwen3NextMTP:
    if cfg.mtp_num_hidden_layers < 1 or not any(n.startswith("mtp.") for n in tensor_files(path)):
        raise ValueError(
            f"speculative decoding: checkpoint {path} has no MTP head (no mtp.* tensors; its "
            f"config gives mtp_num_hidden_layers {cfg.mtp_num_hidden_layers})"
        )
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _HeadOnly(cfg, dtype)))
    params = load_params(path, cfg, abstract, dtype, part=True)
    return nnx.merge(graphdef, params).mtp


def model_fingerprint(path: str) -> str:
    """What identifies the weights `path` names, the same on every machine (the processes of a
    cluster must agree on it)."""
    if path == TINY_NAME:
        return f"{TINY_NAME}-seed-{TINY_SEED}"
    return files_fingerprint(resolve(path))
