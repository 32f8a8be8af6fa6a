"""KV pages on the host: what the prefix cache and the store move between the device and their
tiers, in the canonical layout (`cache_io`).

`values` is `[pages, kv_layers, 2 (k, v), page_size, kv_heads, head_dim]` in the pages' dtype;
8-bit pages carry `scales`, float32 `[pages, kv_layers, 2, kv_heads]` (a value is the page's
element times its scale), and float pages None. A page's values and scales travel together
everywhere, so no tier can hold one without the other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from flipjax.runtime.plan_codec import carried


@carried
@dataclass(frozen=True)
class HostPages:
    values: np.ndarray
    scales: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.values.ndim != 6:
            raise ValueError(
                f"host pages: values of shape {self.values.shape}, not [pages, layers, 2, "
                "page_size, kv_heads, head_dim]"
            )
        want = (*self.values.shape[:3], self.values.shape[4])
        if self.scales is not None and self.scales.shape != want:
            raise ValueError(f"host pages: scales of shape {self.scales.shape}, not {want}")

    def __len__(self) -> int:
        return len(self.values)

    def each(self) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Each page's values [layers, 2, page_size, kv_heads, head_dim] and scales."""
        for i in range(len(self)):
            yield self.values[i], None if self.scales is None else self.scales[i]

    @classmethod
    def stack(cls, pages: Sequence[tuple[np.ndarray, np.ndarray | None]]) -> HostPages:
        """Pages as `each` gives them, stacked (all with scales, or none)."""
        values = np.stack([v for v, _ in pages])
        scales = [s for _, s in pages]
        if all(s is None for s in scales):
            return cls(values)
        if any(s is None for s in scales):
            raise ValueError("host pages: some pages have scales and some do not")
        return cls(values, np.stack(scales))
