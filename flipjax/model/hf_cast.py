"""A HF checkpoint folder with its floating-point tensors in another dtype (`python -m
flipjax.ckpt cast`): the same tensor names and files, `config.json`'s dtype updated, the
tokenizer and every other file copied. The folder appears whole or not at all."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from flipjax.model.folder_writes import whole_folder
from flipjax.model.weights import tensor_files

_FLOATING = ("float16", "bfloat16", "float32", "float64")


def cast(source: str, folder: str, dtype: np.dtype) -> int:
    """Write `source` cast to `dtype` as `folder` (which must not exist); the bytes of tensors
    written. A quantized checkpoint is refused: its scales are not a dtype to cast."""
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "quantized")
        raise ValueError(f"cast: {source} is a {method} checkpoint; cast its unquantized source")
    files = sorted(set(tensor_files(source).values()))
    written = 0
    with whole_folder(os.path.abspath(folder)) as partial:
        for file in files:
            tensors = {}
            with safe_open(file, framework="np") as f:
                metadata = f.metadata()
                for name in f.keys():
                    array = f.get_tensor(name)
                    if array.dtype.name in _FLOATING:
                        array = array.astype(dtype)
                    tensors[name] = array
                    written += array.nbytes
            save_file(tensors, os.path.join(partial, os.path.basename(file)), metadata=metadata)
        for name in os.listdir(source):
            path = os.path.join(source, name)
            if os.path.isfile(path) and not name.endswith(".safetensors") and name != "config.json":
                shutil.copyfile(path, os.path.join(partial, name))
        config["dtype"] = config["torch_dtype"] = np.dtype(dtype).name
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return written
