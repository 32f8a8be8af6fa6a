"""A checkpoint's `quantization_config` (config.json): the one stored format flipjax loads, and
every other refused by name before any tensor is read.

Loaded: compressed-tensors int8 with one scale per output channel, symmetric, as llm-compressor
writes W8A16 and W8A8 (formats `int-quantized`: an int8 `weight`; `pack-quantized`: four int8s
to an int32 `weight_packed`), beside a `weight_scale` [out, 1]. Those weights stay int8 and run
as `--quantization int8` runs (`flipjax.model.quantize`). W8A8's activation scheme (dynamic,
per token) is applied as the reference applies it: each token's activations are rounded to
int8 with their own scale before the product (the product itself runs in floating point).
Refused, naming method, bits and scheme: GPTQ, AWQ, fp8, bitsandbytes, and compressed-tensors
with other bits, types, groups or zero points, or with W8A8 and W8A16 groups mixed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


def describe(qc: dict[str, Any]) -> str:
    """e.g. "gptq, 4-bit weights" or "compressed-tensors, int 8-bit weights (channel)"."""
    method = str(qc.get("quant_method", "unknown method"))
    parts = [method]
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for group in groups.values() if isinstance(groups, dict) else ():
            w = (group or {}).get("weights") or {}
            a = (group or {}).get("input_activations")
            scheme = f"{w.get('type', '?')} {w.get('num_bits', '?')}-bit weights"
            scheme += f" ({w.get('strategy', '?')})"
            if a:
                scheme += f", {a.get('type', '?')} {a.get('num_bits', '?')}-bit activations"
                scheme += f" ({a.get('strategy', '?')})"
            parts.append(scheme)
        if qc.get("format"):
            parts.append(f"format {qc['format']}")
    elif "bits" in qc:
        parts.append(f"{qc['bits']}-bit weights")
    elif qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        parts.append("4-bit weights" if qc.get("load_in_4bit") else "8-bit weights")
    elif "fmt" in qc or method == "fp8":
        parts.append(f"{qc.get('fmt', 'fp8')} weights")
    return ", ".join(parts)


INT8_FORMATS = ("int-quantized", "pack-quantized")
# W8A8's activations: int8, dynamic, per token, symmetric, without groups.
_ACTIVATION_KEYS = ("type", "num_bits", "dynamic", "strategy", "symmetric", "group_size")


@dataclass(frozen=True)
class StoredInt8:
    """A checkpoint's int8 scheme: its compressed-tensors format, and whether it quantizes
    activations too (W8A8: each token's to int8 with its own scale, on the fly)."""

    format: str
    activations: bool


def stored_int8_of(folder: str) -> StoredInt8 | None:
    """`stored_int8` of the checkpoint folder's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        return stored_int8(json.load(f))


def stored_int8(raw: dict[str, Any]) -> StoredInt8 | None:
    """The compressed-tensors int8 scheme config.json declares (None: not quantized); a
    ValueError naming it for any other quantization."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if isinstance(qc, dict) and _is_channel_int8(qc):
        acts = {bool(g.get("input_activations")) for g in qc["config_groups"].values()}
        if len(acts) == 1:
            return StoredInt8(str(qc["format"]), acts.pop())
    what = describe(qc) if isinstance(qc, dict) else repr(qc)
    raise ValueError(
        f"quantization_config: the checkpoint is stored quantized ({what}), a format flipjax "
        "does not load (it loads compressed-tensors int8 with channel-wise symmetric scales); "
        "serve its full-precision checkpoint, with --quantization int8 to quantize it at load"
    )


def _is_channel_int8(qc: dict[str, Any]) -> bool:
    groups = qc.get("config_groups")
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") not in INT8_FORMATS:
        return False
    if not isinstance(groups, dict) or not groups or qc.get("sparsity_config"):
        return False
    for group in groups.values():
        group = group if isinstance(group, dict) else {}
        w, a = group.get("weights") or {}, group.get("input_activations")
        if group.get("format") not in (None, qc["format"]) or group.get("output_activations"):
            return False
        if (w.get("type"), w.get("num_bits"), w.get("strategy")) != ("int", 8, "channel"):
            return False
        if not w.get("symmetric", False) or w.get("dynamic", False):
            return False
        scheme = ("int", 8, True, "token", True, None)
        if a and tuple(a.get(k) for k in _ACTIVATION_KEYS) != scheme:
            return False
    return True
