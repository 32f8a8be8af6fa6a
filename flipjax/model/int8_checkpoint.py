"""The tensors of a weight stored int8 in a compressed-tensors checkpoint, and reading them.

Beside `<weight>.weight_scale` [out, 1], the int8 values are either `<weight>.weight` (int8
[out, in], format `int-quantized`) or `<weight>.weight_packed` (int32 [out, in / 4], four
int8s to each, format `pack-quantized`) with `<weight>.weight_shape` ([out, in]). Packed
values are unpacked by compressed-tensors' own helper. Which formats and schemes a checkpoint
may declare is `checkpoint_quantization`'s to check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

SCALE = ".weight_scale"
PACKED = ".weight_packed"
SHAPE = ".weight_shape"
BITS = 8


def sources(
    prefix: str, shape: tuple[int, ...], available: set[str]
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The tensors (and expected shapes) of the weight `prefix` that is `shape` [in, out] in
    flipjax: its `weight` [out, in], or its int8 parts where a scale is stored."""
    d_in, d_out = shape
    if prefix + SCALE not in available:
        yield prefix + ".weight", (d_out, d_in)
        return
    if prefix + PACKED in available:
        yield prefix + PACKED, (d_out, -(-d_in * BITS // 32))
        yield prefix + SHAPE, (2,)
    else:
        yield prefix + ".weight", (d_out, d_in)
    yield prefix + SCALE, (d_out, 1)


def is_scale(name: str) -> bool:
    return name.endswith(SCALE)


def read_weights(
    read: Callable[[str], np.ndarray], parts: list[str]
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Each weight among `parts` (the tensors `sources` named, one weight after another) as
    ([out, in] values, [out] float32 scales or None for a full-precision weight). The
    weights of one parameter (an expert stack) are all int8 or all not: a
    ValueError naming the stack otherwise."""
    weights: list[tuple[np.ndarray, np.ndarray | None]] = []
    i = 0
    while i < len(parts):
        name = parts[i]
        if name.endswith(PACKED):
            values = _unpack(read(name), read(parts[i + 1]))
            scale, i = read(parts[i + 2]), i + 3
        elif i + 1 < len(parts) and is_scale(parts[i + 1]):
            values, scale, i = read(name), read(parts[i + 1]), i + 2
            if values.dtype != np.int8:
                raise ValueError(f"{name}: has a weight_scale but is {values.dtype}, not int8")
        else:
            weights.append((read(name), None))
            i += 1
            continue
        weights.append((values, np.asarray(scale, np.float32).reshape(-1)))
    if len({s is None for _, s in weights}) > 1:
        first = parts[0].rsplit(".", 1)[0]
        raise ValueError(f"{first}: some of this stack's weights are stored int8 and some not")
    return weights


def _unpack(packed: np.ndarray, shape: np.ndarray) -> np.ndarray:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    # The stated shape is the file's word: bounded by what the packed words can hold before
    # anything is allocated for it (the loader then checks it against the model's).
    dims = [int(d) for d in np.asarray(shape).reshape(-1)]
    if len(dims) != 2 or min(dims) <= 0 or dims[0] * dims[1] > packed.size * (32 // BITS):
        raise ValueError(f"weight_shape {dims} does not fit {packed.size} packed int32 words")
    size = torch.Size(dims)
    return unpack_from_int32(torch.from_numpy(packed), BITS, size).numpy()
