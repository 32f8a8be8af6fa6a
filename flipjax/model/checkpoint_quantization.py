"""What a checkpoint's `quantization_config` (config.json) says, in words, so that a format
flipjax cannot load is refused naming it before any tensor is read.

flipjax quantizes full-precision checkpoints at load (`--quantization int8`,
`flipjax.model.quantize`); a checkpoint stored quantized (GPTQ, AWQ, fp8, bitsandbytes,
compressed-tensors) is refused with its method, bits and scheme named.
"""

from __future__ import annotations

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


def refuse_quantized(raw: dict[str, Any]) -> None:
    """ValueError naming the format when config.json declares a quantized checkpoint."""
    qc = raw.get("quantization_config")
    if qc is None:
        return
    what = describe(qc) if isinstance(qc, dict) else repr(qc)
    raise ValueError(
        f"quantization_config: the checkpoint is stored quantized ({what}), a format flipjax "
        "does not load; serve its full-precision checkpoint, with --quantization int8 to "
        "quantize it at load"
    )
