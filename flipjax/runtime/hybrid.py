"""The hybrid prefix rule, in the one place both the device cache and the store call it.

On a hybrid model a cached prefix is usable only where the KV pages of every full-attention
layer AND the GDN state exist together: KV without the recurrent state at the same position is
worth nothing, because the GDN layers cannot resume. States are kept only on a grid (every
`interval` tokens, a multiple of the page size), so the usable prefix is the deepest grid point
up to which every page is present and at which a state is present.
"""

from __future__ import annotations

from collections.abc import Callable

DEFAULT_GDN_INTERVAL = 256  # tokens between cached GDN states, unless configured


def default_interval(page_size: int) -> int:
    """The default grid: the multiple of the page size nearest at or above 256 tokens."""
    return -(-DEFAULT_GDN_INTERVAL // page_size) * page_size


def check_interval(interval: int, page_size: int) -> None:
    if interval <= 0 or interval % page_size:
        raise ValueError(
            f"gdn_checkpoint_interval: {interval} must be a positive multiple of the page size "
            f"{page_size}"
        )


def is_grid_page(page_index: int, page_size: int, interval: int) -> bool:
    """True when the state at the end of page `page_index` lies on the checkpoint grid."""
    return ((page_index + 1) * page_size) % interval == 0


def usable_prefix(
    num_pages: int,
    page_size: int,
    interval: int,
    has_page: Callable[[int], bool],
    has_state: Callable[[int], bool],
) -> int:
    """Usable prefix length in tokens, given which full pages and grid states are present."""
    check_interval(interval, page_size)
    usable = 0
    for i in range(num_pages):
        if not has_page(i):
            break  # a missing page cuts the prefix here, whatever lies beyond
        if is_grid_page(i, page_size, interval) and has_state(i):
            usable = (i + 1) * page_size
    return usable
