"""The device prefix cache: a radix tree over full token pages, kept in the engine's own pools.

Each node is one full page of tokens under its parent's prefix and holds a reference to the KV
page that has them (the cache is one more holder of the page, through the engine's
`Allocator`). A node whose end lies on the GDN checkpoint grid may also hold a state slot (owned
by the cache) with the recurrent state after its last token. A match is usable only up to the
deepest node on the path that has a state: the hybrid rule of `flipjax.runtime.hybrid`, the
same function the store calls.

Eviction is least recently used. Pages go leaf first, and only where the cache is the last
holder (freeing a page a running request still holds would free nothing). A state can go on its
own: its node keeps the page and simply stops being a match point. The cache never holds more
than `max_states` slots, so running requests always find theirs.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from flipjax.runtime.allocator import Allocator
from flipjax.runtime.hybrid import check_interval, is_grid_page, usable_prefix

OWNER = "prefix-cache"  # the cache's name in the pools' ledgers


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # this page's tokens
    page: int
    parent: Node | None
    depth: int  # pages from the root, this one included
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    slot: int | None = None  # GDN state after this page (grid pages only)
    last_used: int = 0


@dataclass(frozen=True)
class Match:
    tokens: int  # usable tokens (a multiple of the grid), 0 for a miss
    pages: list[int]  # one per usable page
    slot: int | None  # the state at `tokens`


class RadixCache:
    def __init__(self, allocator: Allocator, interval: int, max_states: int):
        page_size = allocator.page_size
        check_interval(interval, page_size)
        self.allocator = allocator
        self.pages = allocator.pages  # read only: who holds a page decides what can be evicted
        self.slots = allocator.slots
        self.page_size = page_size
        self.interval = interval
        self.max_states = max_states
        # A tree per tenant salt (None: unsalted requests), so that no salt finds another's
        # prefixes; a salt's tree goes once its last page is dropped.
        self.roots: dict[str | None, Node] = {}
        self.num_pages = 0
        self.num_states = 0
        self.counters: Counter[str] = Counter()
        self._clock = itertools.count(1)

    # -- lookups --------------------------------------------------------------------------------

    def match(self, token_ids: list[int], salt: str | None = None) -> Match:
        """The deepest usable cached prefix of `token_ids` (among requests with the same
        `salt`); marks its path recently used."""
        path = self._path(token_ids, salt)
        tokens = usable_prefix(
            len(path),
            self.page_size,
            self.interval,
            lambda i: True,
            lambda i: path[i].slot is not None,
        )
        used = path[: tokens // self.page_size]
        self._touch(used)
        self.counters["lookups"] += 1
        if used:
            self.counters["hits"] += 1
            self.counters["hit_tokens"] += tokens
        return Match(tokens, [n.page for n in used], used[-1].slot if used else None)

    # -- inserting ------------------------------------------------------------------------------

    def insert(self, token_ids: list[int], pages: list[int], salt: str | None = None) -> int:
        """Cache the full pages of `token_ids`, where `pages[i]` holds page i. Pages already
        cached under the same tokens stay as they are. Returns the number of pages added."""
        ps = self.page_size
        node = self.roots.setdefault(salt, Node((), -1, None, 0))
        path, added = [], 0
        for i in range(min(len(pages), len(token_ids) // ps)):
            key = tuple(token_ids[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                self.allocator.share_page(pages[i], OWNER)
                child = Node(key, pages[i], node, node.depth + 1)
                node.children[key] = child
                self.num_pages += 1
                added += 1
            node = child
            path.append(node)
        self._touch(path)
        return added

    def add_state(
        self, token_ids: list[int], copy_into: Callable[[int], None], salt: str | None = None
    ) -> bool:
        """Keep the GDN state after `token_ids` (a grid position whose pages are cached):
        `copy_into(slot)` copies it into a cache slot. False when it cannot be kept."""
        pages = len(token_ids) // self.page_size
        if len(token_ids) % self.interval or not pages:
            raise ValueError(f"gdn state: {len(token_ids)} tokens is not on the grid")
        path = self._path(token_ids, salt)
        if len(path) < pages:
            return False  # the pages were not cached (or were evicted meanwhile)
        node = path[-1]
        if node.slot is not None:
            self._touch(path)
            return True
        if self.num_states >= self.max_states or not self.allocator.free_slots:
            if not self.evict_states(1):
                self.counters["states_refused"] += 1
                return False
        node.slot = self.allocator.allocate_slot(OWNER)
        copy_into(node.slot)
        self.num_states += 1
        self._touch(path)
        return True

    def sole_pages(self) -> int:
        """Pages only the cache holds: what evicting everything would free."""
        return sum(self.pages.holders(n.page) == {OWNER} for n in self._nodes())

    # -- eviction -------------------------------------------------------------------------------

    def evict_pages(self, wanted: int) -> int:
        """Free up to `wanted` pages, least recently used leaves first; returns pages freed."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < wanted:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._drop(node)
            freed += 1
            if parent is not None and parent.parent is not None and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.counters["evicted_pages"] += freed
        return freed

    def evict_states(self, wanted: int) -> int:
        """Release up to `wanted` state slots, least recently used first; their nodes keep their
        pages. Returns slots released."""
        nodes = sorted((n for n in self._nodes() if n.slot is not None), key=lambda n: n.last_used)
        for node in nodes[:wanted]:
            self._release_state(node)
        released = min(wanted, len(nodes))
        self.counters["evicted_states"] += released
        return released

    def flush(self) -> tuple[int, int]:
        """Drop everything; returns (pages, states) the cache held. Running requests keep the
        pages they share."""
        held = (self.num_pages, self.num_states)
        for node in list(self._nodes()):
            if node.slot is not None:
                self._release_state(node)
            self.allocator.release_page(node.page, OWNER)
        self.roots.clear()
        self.num_pages = 0
        self.counters["flushes"] += 1
        return held

    def renumber(self, renumbered: dict[int, int]) -> None:
        """Follow the pool's renumbering when it shrinks (`Allocator.resize_pages`)."""
        for node in self._nodes():
            node.page = renumbered.get(node.page, node.page)

    def check(self) -> None:
        """Prove the tree and the pools agree: each node's page is held by the cache, each
        state slot is owned by it, and the cache holds nothing else."""
        self.counters["checked"] += 1
        nodes = list(self._nodes())
        pages = [n.page for n in nodes]
        if len(set(pages)) != len(pages) or len(pages) != self.num_pages:
            raise AssertionError(f"prefix cache: {len(pages)} nodes, {self.num_pages} counted")
        for node in nodes:
            if OWNER not in self.pages.holders(node.page):
                raise AssertionError(f"prefix cache: page {node.page} is in the tree, not held")
            if node.slot is not None and self.slots.owner(node.slot) != OWNER:
                raise AssertionError(f"prefix cache: slot {node.slot} is in the tree, not owned")
            if node.slot is not None and not is_grid_page(
                node.depth - 1, self.page_size, self.interval
            ):
                raise AssertionError(f"prefix cache: a state off the grid at page {node.depth}")
        states = sum(n.slot is not None for n in nodes)
        if states != self.num_states or states > self.max_states:
            raise AssertionError(f"prefix cache: {states} states, {self.num_states} counted")

    # -- internals ------------------------------------------------------------------------------

    def _path(self, token_ids: list[int], salt: str | None = None) -> list[Node]:
        ps, node, path = self.page_size, self.roots.get(salt), []
        if node is None:
            return path
        for i in range(len(token_ids) // ps):
            node = node.children.get(tuple(token_ids[i * ps : (i + 1) * ps]))
            if node is None:
                break
            path.append(node)
        return path

    def _nodes(self):
        stack = [n for root in self.roots.values() for n in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _touch(self, path: list[Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_used = now

    def _evictable(self, node: Node) -> bool:
        return not node.children and self.pages.holders(node.page) == {OWNER}

    def _drop(self, node: Node) -> None:
        if node.slot is not None:
            self._release_state(node)
        self.allocator.release_page(node.page, OWNER)
        parent = node.parent
        del parent.children[node.key]
        self.num_pages -= 1
        if parent.parent is None and not parent.children:  # a tree emptied: forget its salt
            self.roots = {s: r for s, r in self.roots.items() if r is not parent}

    def _release_state(self, node: Node) -> None:
        self.allocator.release_slot(node.slot, OWNER)
        node.slot = None
        self.num_states -= 1
