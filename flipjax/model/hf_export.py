"""A model's parameters written as a HF checkpoint folder: `config.json` and `model.safetensors`
with the checkpoint's names and layouts (the inverse of `weights.load_params`).

`Linear` kernels go back to `[out, in]`, stacked experts to one tensor per expert, and the MTP
head, where the model has one, to its `mtp.*` tensors. The folder appears whole or not at all
(`folder_writes.whole_folder`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from flipjax.model.config import ModelConfig
from flipjax.model.folder_writes import whole_folder
from flipjax.model.weights import EXPERT_WEIGHT, KERNEL, SINGLE_FILE, param_name


def checkpoint_tensors(params: nnx.State) -> Iterator[tuple[str, np.ndarray]]:
    """(checkpoint name, host array) of every parameter, as a HF checkpoint stores it."""
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, array = param_name(key_path), np.asarray(jax.device_get(leaf))
        match = EXPERT_WEIGHT.match(name)
        if name.endswith(KERNEL):
            yield name.removesuffix(KERNEL) + ".weight", np.ascontiguousarray(array.T)
        elif match is not None:
            prefix, proj = match.groups()
            for e in range(array.shape[0]):
                yield f"{prefix}.{e}.{proj}.weight", np.ascontiguousarray(array[e].T)
        else:
            yield name, array


def hf_config(cfg: ModelConfig, dtype: str) -> dict[str, object]:
    """`config.json` as transformers' `Qwen3NextConfig` reads it."""
    fields = cfg.to_dict()
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_act": "silu",
        "dtype": dtype,
        **fields,
    }


def write_checkpoint(
    folder: str,
    params: nnx.State,
    cfg: ModelConfig,
    extra_files: Callable[[str], None] | None = None,
) -> str:
    """Write the checkpoint folder; `extra_files(partial_folder)` adds the tokenizer and the
    like before the folder is renamed into place. Returns the folder's absolute path."""
    folder = os.path.abspath(folder)
    with whole_folder(folder) as partial:
        tensors = dict(checkpoint_tensors(params))
        dtypes = {a.dtype.name for a in tensors.values()}
        save_file(tensors, os.path.join(partial, SINGLE_FILE), metadata={"format": "pt"})
        dtype = "bfloat16" if "bfloat16" in dtypes else "float32"
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(hf_config(cfg, dtype), f, indent=1)
        if extra_files is not None:
            extra_files(partial)
    return folder
