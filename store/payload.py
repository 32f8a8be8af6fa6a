"""Canonical payloads: the one byte layout of a KV page and of a GDN anchor, for every layout.

KV page: `[full_attention_layers, 2 (k, v), page_size, kv_heads, head_dim]` in the pages' dtype,
C order, little-endian, all KV heads (whatever TP width computed them); 8-bit pages then their
float32 scales `[full_attention_layers, 2, kv_heads]`.
GDN anchor: recurrent `[gdn_layers, v_heads, k_head_dim, v_head_dim]` float32, then conv
`[gdn_layers, conv_kernel - 1, conv_dim]` in the model's dtype (`kv_dtype`); the state after the
page's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from flipjax.model.config import ModelConfig
from flipjax.model.state_shapes import state_shapes
from kernels_pallas.paged_attention.pages import SCALED_PAGE_DTYPES

_DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Pages alone may also be 8-bit, with scales; by name, with the largest magnitude each holds.
_SCALED = {jnp.dtype(d).name: (np.dtype(d), top) for d, top in SCALED_PAGE_DTYPES.items()}


def numpy_dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise ValueError(f"kv_dtype: {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def page_numpy_dtype(name: str) -> np.dtype:
    if name in _SCALED:
        return _SCALED[name][0]
    if name not in _DTYPES:
        raise ValueError(f"page_dtype: {name!r} is not one of {sorted({**_DTYPES, **_SCALED})}")
    return _DTYPES[name]


@dataclass(frozen=True)
class PayloadLayout:
    kv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]
    conv_shape: tuple[int, ...]
    kv_dtype: str  # the model's: the GDN conv states'
    page_dtype: str  # the KV pages'

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, page_size: int, kv_dtype: str, page_dtype: str | None = None
    ) -> PayloadLayout:
        numpy_dtype(kv_dtype)
        page_numpy_dtype(page_dtype or kv_dtype)
        shapes = state_shapes(cfg)
        return cls(
            kv_shape=(shapes.kv_layers, 2, page_size, *shapes.kv_token),
            recurrent_shape=(shapes.gdn_layers, *shapes.recurrent),
            conv_shape=(shapes.gdn_layers, *shapes.conv),
            kv_dtype=kv_dtype,
            page_dtype=page_dtype or kv_dtype,
        )

    @property
    def scaled(self) -> bool:
        return self.page_dtype in _SCALED

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return (*self.kv_shape[:2], self.kv_shape[3])

    def encode_kv(self, kv: np.ndarray, scales: np.ndarray | None = None) -> bytes:
        """A page's payload: its values and, for 8-bit pages (only), their scales."""
        if (scales is not None) != self.scaled:
            raise ValueError(f"kv page: {self.page_dtype} pages have scales exactly when 8-bit")
        values = _encode(kv, self.kv_shape, page_numpy_dtype(self.page_dtype), "kv page")
        if scales is None:
            return values
        return values + _encode(scales, self.scale_shape, np.dtype("<f4"), "kv page scales")

    def decode_kv(self, payload: bytes) -> tuple[np.ndarray, np.ndarray | None]:
        """A page's values and scales (None for float pages) from its payload."""
        dtype = page_numpy_dtype(self.page_dtype)
        if not self.scaled:
            return _decode(payload, self.kv_shape, dtype, "kv page"), None
        split = int(np.prod(self.kv_shape)) * dtype.itemsize
        values = _decode(payload[:split], self.kv_shape, dtype, "kv page")
        scales = _decode(payload[split:], self.scale_shape, np.dtype("<f4"), "kv page scales")
        # A page's value is at most its scale times the format's top: past float32's range
        # it is inf, and attention over it NaN.
        bound = np.finfo(np.float32).max / _SCALED[self.page_dtype][1]
        if not np.all((scales >= 0) & (scales <= bound)):
            raise ValueError("kv page scales: a scale is negative, not finite or past float32")
        if dtype != np.int8 and np.any((values.view(np.uint8) & 0x7F) == 0x7F):
            raise ValueError("kv page: a value is fp8's NaN (no page is ever written with one)")
        return values, scales

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
