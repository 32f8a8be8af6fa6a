"""Orbax checkpoints of a model: convert from HF safetensors, inspect, restore into a layout.

A converted folder holds the model's `config.json` and tokenizer files (copied), the parameter
tree as an orbax checkpoint under `params/` (names are the HF names, experts stacked as the
model keeps them), and `flipjax_orbax.json` (format version and dtype). Conversion writes to a
`.partial` sibling and renames it into place last, so a folder that exists is complete.
Restoring reads each array straight into the shardings asked for: under a layout, no device
ever holds the whole model.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.folder_writes import whole_folder
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.weights import load_params, param_name

MARKER = "flipjax_orbax.json"
FORMAT_VERSION = 2  # 2: Linear kernels are [in, out]
PARAMS_DIR = "params"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HF_TYPE = {"model_type": "qwen3_next"}


def is_orbax(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its parameters' shapes and dtypes, without making any (a copy of
    the state: callers may fill it)."""
    graphdef, state = _abstract_params(cfg, jnp.dtype(dtype))
    return graphdef, jax.tree.map(lambda leaf: leaf, state)


@functools.lru_cache(maxsize=8)
def _abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """Kept per config and dtype: tracing the model's initializers costs each load a few
    tenths of a second, which a process that loads one model again (another engine, a test)
    then pays once."""
    model = nnx.eval_shape(lambda: Qwen3NextForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def convert(hf_dir: str, out_dir: str, dtype: jnp.dtype, progress: bool = True) -> int:
    """Write `hf_dir`'s weights as an orbax checkpoint at `out_dir`; returns bytes written."""
    if os.path.exists(out_dir):
        raise FileExistsError(f"output: {out_dir} already exists; refusing to overwrite it")
    cfg = ModelConfig.from_hf(hf_dir)
    _, abstract = abstract_params(cfg, dtype)
    params = load_params(hf_dir, cfg, abstract, dtype, on_device=False, progress=progress)
    return save(out_dir, params, cfg, dtype, copy_from=hf_dir)


def save(
    out_dir: str, params: nnx.State, cfg: ModelConfig, dtype: jnp.dtype, copy_from: str | None
) -> int:
    """Write `params` as a checkpoint folder; config and tokenizer files come from `copy_from`
    (an HF folder), or the config is written from `cfg`. Returns the parameter bytes."""
    with whole_folder(os.path.abspath(out_dir)) as partial:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(partial, PARAMS_DIR), nnx.to_pure_dict(params))
        checkpointer.wait_until_finished()
        if copy_from is None:
            _write_json(os.path.join(partial, "config.json"), {**cfg.to_dict(), **_HF_TYPE})
        else:
            for name in os.listdir(copy_from):
                source = os.path.join(copy_from, name)
                if (
                    os.path.isfile(source)
                    and not name.endswith(_WEIGHT_SUFFIXES)
                    and ("index" not in name)
                ):
                    shutil.copy2(source, partial)  # config, tokenizer, generation config
        marker = {"format": FORMAT_VERSION, "dtype": jnp.dtype(dtype).name}
        _write_json(os.path.join(partial, MARKER), marker)
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_dtype(path: str) -> jnp.dtype:
    """The dtype a converted checkpoint's parameters were written in."""
    return jnp.dtype(_check_marker(path)["dtype"])


def _check_marker(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: orbax checkpoint format {marker.get('format')!r} is not the supported "
            f"{FORMAT_VERSION}; convert the HF checkpoint again (`python -m flipjax.ckpt "
            "convert`)"
        )
    return marker


def restore_params(
    path: str, cfg: ModelConfig, abstract: nnx.State, shardings: nnx.State | None = None
) -> nnx.State:
    """Read the checkpoint at `path` into `abstract`'s structure and dtypes, each array placed
    by `shardings` (a matching tree of shardings), or as host arrays without them."""
    _check_marker(path)
    if shardings is None:  # numpy leaves: orbax restores into host memory
        target = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), abstract)
    else:
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
    restored = ocp.StandardCheckpointer().restore(
        os.path.join(path, PARAMS_DIR), nnx.to_pure_dict(target)
    )
    nnx.replace_by_pure_dict(target, restored)
    return target


def inspect(path: str) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, dtype, bytes) of every stored array, by name."""
    _check_marker(path)
    meta = ocp.StandardCheckpointer().metadata(os.path.join(path, PARAMS_DIR))
    tree = meta.item_metadata.tree
    rows = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(leaf.shape)
        dtype = np.dtype(leaf.dtype)
        rows.append((param_name(key_path), shape, dtype.name, int(np.prod(shape)) * dtype.itemsize))
    return sorted(rows)
