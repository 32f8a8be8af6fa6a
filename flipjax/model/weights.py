"""Load HF safetensors checkpoints (single file or sharded) into the NNX parameter state.

Every expected tensor must be present with its exact shape, and every tensor in the files must
be used (`mtp.*`, the multi-token-prediction head, is the one known extra and is skipped).
Problems are collected and reported together, by name, before anything is built.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm import tqdm

from flipjax.model import int8_checkpoint, tensor_rows
from flipjax.model.config import ModelConfig
from flipjax.model.scale_names import scale_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A stacked experts' weight [E, in, out] of a model layer or an MTP layer, and its projection.
EXPERT_WEIGHT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$"
)
_BLOCK_BYTES = 8 << 20  # what a tensor is read in, of the model's dtype
KERNEL = ".kernel"  # a `Linear`'s [in, out]: the checkpoint's `.weight` [out, in], transposed
_IGNORED_PREFIXES = ("mtp.",)


class WeightsError(ValueError):
    """The checkpoint does not match the model its config describes."""


def param_name(path: tuple[Any, ...]) -> str:
    """Dotted checkpoint-style name of a flattened NNX state path."""
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        if name == "value":
            continue
        parts.append(str(name))
    return ".".join(parts)


def tensor_files(path: str) -> dict[str, str]:
    """Map every tensor name to the file that holds it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise WeightsError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(single, framework="np") as f:
        return {name: single for name in f.keys()}


class _Reader:
    """Opens each shard once and reads tensors lazily by name."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self._handles: dict[str, Any] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        # A handle of its own, closed after: a handle maps its whole file, and every page a
        # read touches would stay resident (counted in the process's RSS) until the load ends.
        with safe_open(self.files[name], framework="np") as f:
            return f.get_tensor(name)

    def read_into(self, name: str, out: np.ndarray, transpose: bool = False) -> None:
        """Tensor `name` (transposed: a 2-D one) into `out`, cast to its dtype a block of rows
        at a time: a large tensor (an embedding, the head) is never held whole in the file's
        precision beside its copy in the model's."""
        rows = tensor_rows.open_rows(self.files[name], name)
        if rows is not None and len(rows.shape) >= 2:  # read by offset: no mapped file pages
            _fill(out, rows.blocks(_rows_per_block(rows.shape, out)), transpose)
            return
        with safe_open(self.files[name], framework="np") as f:
            tensor = f.get_slice(name)
            shape = tuple(tensor.get_shape())
            if len(shape) < 2:
                out[...] = f.get_tensor(name)
                return
            step = _rows_per_block(shape, out)
            # A slice past the end is an error here.
            blocks = ((r, tensor[r : min(r + step, shape[0])]) for r in range(0, shape[0], step))
            _fill(out, blocks, transpose)

    def _handle(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="np")
        return self._handles[file]


def _rows_per_block(shape: tuple[int, ...], out: np.ndarray) -> int:
    """Rows of a tensor of `shape` that make `_BLOCK_BYTES` of `out`'s dtype."""
    return max(1, _BLOCK_BYTES // (out.itemsize * math.prod(shape[1:])))


def _fill(out: np.ndarray, blocks: Iterable[tuple[int, np.ndarray]], transpose: bool) -> None:
    """Each (first row, rows) block into `out` (into its columns, transposed), cast to its
    dtype."""
    for first, block in blocks:
        last = first + len(block)
        if transpose:
            out[:, first:last] = block.T
        else:
            out[first:last] = block


def _sources(
    name: str, shape: tuple[int, ...], available: set[str]
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Checkpoint tensors (and their expected shapes) that make up one model parameter. A
    weight stored int8 (`int8_checkpoint`) brings its scale and, packed, its shape."""
    if name.endswith(KERNEL):
        yield from int8_checkpoint.sources(name.removesuffix(KERNEL), shape, available)
        return
    match = EXPERT_WEIGHT.match(name)
    if match is None:
        yield name, shape
        return
    prefix, proj = match.groups()
    # Ours is [E, in, out]; the checkpoint has one [out, in] tensor per expert.
    for e in range(shape[0]):
        yield from int8_checkpoint.sources(f"{prefix}.{e}.{proj}", shape[1:], available)


def load_params(
    path: str,
    cfg: ModelConfig,
    abstract: nnx.State,
    dtype: jnp.dtype,
    on_device: bool = True,
    progress: bool = False,
    scales: dict[str, np.ndarray] | None = None,
    quantize: Callable[[str, np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None = None,
    quantized: dict[str, np.ndarray] | None = None,
    part: bool = False,
) -> nnx.State:
    """Fill `abstract` (an eval_shape'd NNX state) from the safetensors files under `path`.

    Every problem is found before anything is read. `on_device=False` keeps host (numpy)
    arrays, for conversion; `progress` shows a bar over the tensors. Weights stored int8 are
    kept int8, their scales put in `scales` by the name of their `Linear.scale` or experts'
    `<proj>_scale` (`flipjax.model.quantize.attach_scales`); without `scales` they are refused.
    `quantize` (`quantize.weight_quantizer`) quantizes the others as they are read, their
    scales put in `quantized` (required with it): no float copy of the whole model is held.
    `part`: `abstract` is a part of the checkpoint (the MTP head alone): the tensors it does
    not name are left unread rather than refused.
    """
    reader = _Reader(tensor_files(path))
    available = set(reader.files)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    missing: list[str] = []
    misshaped: list[str] = []
    used: set[str] = set()
    plan: list[list[str]] = []
    for key_path, leaf in leaves:
        name = param_name(key_path)
        parts = []
        for src, want in _sources(name, tuple(leaf.shape), available):
            parts.append(src)
            if src not in available:
                missing.append(src)
                continue
            used.add(src)
            got = reader.shape(src)
            if got != want:
                misshaped.append(f"{src} (expected {list(want)}, found {list(got)})")
        plan.append(parts)
    unread = () if part else sorted(available - used)
    unexpected = [n for n in unread if not n.startswith(_IGNORED_PREFIXES)]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(sorted(missing))}")
    if misshaped:
        problems.append(f"wrongly shaped tensors: {', '.join(misshaped)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    stored_int8 = any(int8_checkpoint.is_scale(n) for n in used)
    if stored_int8 and scales is None:
        problems.append("its weights are stored int8, which this reader does not convert")
    if problems:
        raise WeightsError(f"checkpoint {path} does not match its config: " + "; ".join(problems))

    arrays = []
    todo = zip(leaves, plan, strict=True)
    for (key_path, leaf), parts in tqdm(todo, total=len(plan), disable=not progress, unit="tensor"):
        name = param_name(key_path)
        expert = EXPERT_WEIGHT.match(name) is not None
        weight = expert or name.endswith(KERNEL)
        full_precision = not any(
            int8_checkpoint.is_scale(p) or p.endswith(int8_checkpoint.PACKED) for p in parts
        )
        if weight and full_precision:
            # [out, in] tensors in, [in, out] (or [E, in, out]) out, a block at a time
            host = np.empty(tuple(leaf.shape), dtype)
            for i, part in enumerate(parts):
                reader.read_into(part, host[i] if expert else host, transpose=True)
        elif weight:
            try:
                weights = int8_checkpoint.read_weights(reader.read, parts)
            except ValueError as e:
                raise WeightsError(f"checkpoint {path}: {e}") from e
            host = np.ascontiguousarray(np.stack([w.T for w, _ in weights]))
            host = host if expert else host[0]
            if host.shape != tuple(leaf.shape):  # a packed weight's stated shape, say
                raise WeightsError(
                    f"checkpoint {path}: {parts[0]} unpacks to {list(host.shape)}, "
                    f"expected {list(leaf.shape)}"
                )
            if weights[0][1] is not None and scales is not None:  # stays int8
                scale = np.stack([s for _, s in weights])
                scales[scale_name(name)] = scale if expert else scale[0]
                arrays.append(jnp.asarray(host) if on_device else host)
                continue
        else:
            host = np.empty(tuple(leaf.shape), dtype)
            reader.read_into(parts[0], host)
        pair = quantize(name, host) if quantize is not None else None
        if pair is not None:
            host, quantized[scale_name(name)] = pair
        arrays.append(jnp.asarray(host) if on_device else host)
    return jax.tree_util.tree_unflatten(treedef, arrays)
