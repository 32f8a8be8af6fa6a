"""Shape buckets: sizes are rounded up to powers of two so a few programs serve every batch."""

from __future__ import annotations

MIN_PREFILL_BUCKET = 16  # the smallest prefill chunk shape; a pipeline never cuts below it


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pow2_range(lo: int, hi: int) -> list[int]:
    """The powers of two from `lo` (itself one) up to the first at or above `hi`."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
