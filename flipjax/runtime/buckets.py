"""Shape buckets: sizes are rounded up to powers of two so a few programs serve every batch."""

from __future__ import annotations

MIN_PREFILL_BUCKET = 16  # the smallest prefill chunk shape; a pipeline never cuts below it
# The most positions a prefill call of several requests' chunks covers. Rows together share
# each weight read and fill the experts' groups (a 128-token chunk of a 16-expert top-2 model
# gives each expert 16 rows); a chunk of this length alone already has rows enough, and each
# further shape is one more program to compile at start.
PREFILL_ROWS_TOKENS = 1024


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def prefill_bucket(tokens: int) -> int:
    """The shape a prefill chunk of `tokens` positions runs in: the runner pads it to this, and
    the step groups chunks into calls by it."""
    return pow2_bucket(tokens, MIN_PREFILL_BUCKET)


def pow2_range(lo: int, hi: int) -> list[int]:
    """The powers of two from `lo` (itself one) up to the first at or above `hi`."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def prefill_rows(tokens: int, max_rows: int, max_prefill_tokens: int) -> int:
    """The most chunks of bucket `tokens` one prefill call takes: a power of two, at most
    `max_rows`, covering at most `max_prefill_tokens` and `PREFILL_ROWS_TOKENS` positions
    (at least 1)."""
    cap = min(max_prefill_tokens, PREFILL_ROWS_TOKENS) // tokens
    rows = 1
    while rows * 2 <= min(max_rows, cap):
        rows *= 2
    return rows
