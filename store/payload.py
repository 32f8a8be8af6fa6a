"""Canonical payloads: the one byte layout of a KV page and of a GDN anchor, for every layout.

KV page: `[full_attention_layers, 2 (k, v), page_size, kv_heads, head_dim]` in the KV dtype,
C order, little-endian, all KV heads (whatever TP width computed them).
GDN anchor: recurrent `[gdn_layers, v_heads, k_head_dim, v_head_dim]` float32, then conv
`[gdn_layers, conv_kernel - 1, conv_dim]` in the KV dtype; the state after the page's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from flipjax.model.config import ModelConfig
from flipjax.model.state_shapes import state_shapes

_DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def numpy_dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise ValueError(f"kv_dtype: {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class PayloadLayout:
    kv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]
    conv_shape: tuple[int, ...]
    kv_dtype: str

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int, kv_dtype: str) -> PayloadLayout:
        numpy_dtype(kv_dtype)
        shapes = state_shapes(cfg)
        return cls(
            kv_shape=(shapes.kv_layers, 2, page_size, *shapes.kv_token),
            recurrent_shape=(shapes.gdn_layers, *shapes.recurrent),
            conv_shape=(shapes.gdn_layers, *shapes.conv),
            kv_dtype=kv_dtype,
        )

    def encode_kv(self, kv: np.ndarray) -> bytes:
        return _encode(kv, self.kv_shape, numpy_dtype(self.kv_dtype), "kv page")

    def decode_kv(self, payload: bytes) -> np.ndarray:
        return _decode(payload, self.kv_shape, numpy_dtype(self.kv_dtype), "kv page")

    def encode_gdn(self, recurrent: np.ndarray, conv: np.ndarray) -> bytes:
        rec = _encode(recurrent, self.recurrent_shape, np.dtype("<f4"), "gdn recurrent")
        return rec + _encode(conv, self.conv_shape, numpy_dtype(self.kv_dtype), "gdn conv")

    def decode_gdn(self, payload: bytes) -> tuple[np.ndarray, np.ndarray]:
        split = int(np.prod(self.recurrent_shape)) * 4
        rec = _decode(payload[:split], self.recurrent_shape, np.dtype("<f4"), "gdn recurrent")
        conv = _decode(payload[split:], self.conv_shape, numpy_dtype(self.kv_dtype), "gdn conv")
        return rec, conv


def _encode(a: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> bytes:
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"{what}: shape {a.shape} is not the canonical {shape}")
    if a.dtype != dtype:
        raise ValueError(f"{what}: dtype {a.dtype} is not the canonical {dtype}")
    return np.ascontiguousarray(a).tobytes()


def _decode(payload: bytes, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    want = int(np.prod(shape)) * dtype.itemsize
    if len(payload) != want:
        raise ValueError(f"{what}: {len(payload)} bytes, the canonical layout has {want}")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)
