"""`python -m flipjax.bench store`: the store's tiers against raw file I/O of the same bytes.

Entries are KV pages of the engine benchmark's reference model (page size 16, fp32). Disk-tier
puts are durable (entries, then their index records, each behind a barrier) and gets verify a
checksum; the peer writes the same bytes to one file with one fsync and reads them back, from
the page cache and again once the kernel has dropped the cached pages. `disk put_many` is the
group commit the tiered store's worker uses. Also reported: host-tier put/get and the
latency of a 4k-token prefix lookup (256 pages, key chain and presence checks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np

from flipjax.benchmarks.engine import REFERENCE_CONFIG
from flipjax.model.config import ModelConfig

if TYPE_CHECKING:  # store sits above flipjax: imported inside main(), never at module level
    from store.backend import StoreTier
    from store.entry import Kind


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**20


def _time_put_get(
    tier: StoreTier, kind: Kind, keys: list[bytes], payload: bytes
) -> tuple[float, float]:
    """Seconds to put every key, then to get (and verify) every key back."""
    t0 = time.perf_counter()
    for k in keys:
        tier.put(k, kind, payload)
    put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys:
        if tier.get(k, kind) is None:
            raise RuntimeError(f"{tier.name} tier lost an entry it was given room for")
    return put, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench store", description=__doc__)
    p.add_argument("--entries", type=int, default=1000)
    p.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from store.entry import Kind
    from store.host import HostTier
    from store.keys import ModelIdentity, page_keys, root_key
    from store.payload import PayloadLayout
    from store.tiered import TieredStore

    cfg = ModelConfig.from_hf({**REFERENCE_CONFIG, "model_type": "qwen3_next"})
    layout = PayloadLayout.for_model(cfg, 16, "float32")
    rng = np.random.default_rng(0)
    page = rng.standard_normal(layout.kv_shape).astype(np.float32)
    payload = layout.encode_kv(page)
    ident = ModelIdentity.create(cfg.to_dict(), "bench", "float32", 16)
    root = root_key(ident)
    tokens = rng.integers(0, cfg.vocab_size, 16 * args.entries).tolist()
    keys = page_keys(root, tokens, 16)
    total = len(payload) * len(keys)
    print(f"{len(keys)} entries of {len(payload) / 1024:.0f} KiB ({total / 2**20:.0f} MiB)")

    rows: dict[str, list[float]] = {}  # path -> seconds per round
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        # Rounds interleave each path with its raw peer, so a noisy neighbour hits both.
        for r in range(args.rounds):
            here = os.path.join(folder, str(r))
            os.makedirs(here)
            for name, seconds in _round(here, ident.digest(), keys, payload).items():
                rows.setdefault(name, []).append(seconds)
            shutil.rmtree(here)
        host = HostTier(total * 2)
        host_put, host_get = _time_put_get(host, Kind.KV_PAGE, keys, payload)

        store = TieredStore(root, 16, 256, host, None)
        for i in store.anchor_pages(4096):
            store.put(keys[i], Kind.GDN_ANCHOR, b"state")
        prefix = tokens[:4096]
        store.lookup(prefix)
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            found = store.lookup(prefix)
        lookup = (time.perf_counter() - t0) / n
        assert found.tokens == min(4096, len(keys) * 16 // 256 * 256)
        store.close()

    print(f"median of {args.rounds} rounds; 'vs raw' is the median of each round's ratio")
    print(f"{'path':<27} {'MiB/s':>9} {'vs raw':>7}")
    for name, peer in PEERS.items():
        rate = _rate(total, statistics.median(rows[name]))
        ratio = ""
        if peer is not None:
            each = [p / t for p, t in zip(rows[peer], rows[name], strict=True)]
            ratio = f"{statistics.median(each):>6.0%}"
        print(f"{name:<27} {rate:>9.0f} {ratio:>7}")
    print(f"{'host put':<27} {_rate(total, host_put):>9.0f}")
    print(f"{'host get':<27} {_rate(total, host_get):>9.0f}")
    print(f"lookup of a 4096-token prefix: {lookup * 1e3:.2f} ms")


# Each path and the raw I/O it is measured against.
PEERS = {
    "raw write": None,
    "disk put, 1 per commit": "raw write",
    "disk put_many, 64 a commit": "raw write",
    "raw read": None,
    "disk get": "raw read",
    "raw read, from disk": None,
    "disk get, from disk": "raw read, from disk",
}


def _round(folder: str, identity: bytes, keys: list[bytes], payload: bytes) -> dict[str, float]:
    from store.disk import DiskTier
    from store.entry import Kind

    total = len(payload) * len(keys)
    out: dict[str, float] = {}
    raw = os.path.join(folder, "raw.bin")
    t0 = time.perf_counter()
    with open(raw, "wb") as f:
        for _ in keys:
            f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    out["raw write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(raw, "rb") as f:
        while f.read(len(payload)):
            pass
    out["raw read"] = time.perf_counter() - t0
    os.sync()
    single = DiskTier(os.path.join(folder, "single"), identity, budget_bytes=total * 2)
    out["disk put, 1 per commit"], out["disk get"] = _time_put_get(
        single, Kind.KV_PAGE, keys, payload
    )
    # Group commit, as the tiered store's worker writes: batches of 64.
    batched = DiskTier(os.path.join(folder, "batched"), identity, total * 2)
    t0 = time.perf_counter()
    for i in range(0, len(keys), 64):
        batched.put_many([(k, Kind.KV_PAGE, payload) for k in keys[i : i + 64]])
    out["disk put_many, 64 a commit"] = time.perf_counter() - t0
    # The same reads once the page cache has let the bytes go: what a disk tier is for.
    os.sync()
    _drop_cache([raw])
    t0 = time.perf_counter()
    with open(raw, "rb") as f:
        while f.read(len(payload)):
            pass
    out["raw read, from disk"] = time.perf_counter() - t0
    segments = os.path.join(single.root, "segments")
    _drop_cache([os.path.join(segments, n) for n in os.listdir(segments)])
    t0 = time.perf_counter()
    for k in keys:
        if single.get(k, Kind.KV_PAGE) is None:
            raise RuntimeError("disk tier lost an entry it was given room for")
    out["disk get, from disk"] = time.perf_counter() - t0
    return out


def _drop_cache(paths: list[str]) -> None:
    """Ask the kernel to forget the cached pages of files whose bytes are durable."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
