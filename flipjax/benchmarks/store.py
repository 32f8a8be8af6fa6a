"""`python -m flipjax.bench store`: the store's tiers against raw file I/O of the same bytes.

Entries are KV pages of the engine benchmark's reference model (page size 16, fp32). Disk-tier
puts are durable (fsync, rename, directory fsync per entry) and gets verify a checksum; the peer
writes the same bytes to one file with one fsync and reads them back. `disk put_many` is the
group commit the tiered store's worker uses (batches of 64, two barriers each). A line writes one
file per entry without fsync: the ceiling of the one-file-per-entry design. Also reported: host-tier
put/get and the latency of a 4k-token prefix lookup (256 pages, key chain and presence checks).
"""

from __future__ import annotations

import argparse
import os
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
    args = p.parse_args(argv)

    from store.disk import DiskTier
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

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        raw = os.path.join(folder, "raw.bin")
        t0 = time.perf_counter()
        with open(raw, "wb") as f:
            for _ in keys:
                f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        raw_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(raw, "rb") as f:
            while f.read(len(payload)):
                pass
        raw_read = time.perf_counter() - t0
        # The file-per-entry ceiling: one file each, no fsync, no verification.
        os.makedirs(os.path.join(folder, "files"))
        t0 = time.perf_counter()
        for i in range(len(keys)):
            with open(os.path.join(folder, "files", str(i)), "wb") as f:
                f.write(payload)
        per_file_write = time.perf_counter() - t0

        disk = DiskTier(os.path.join(folder, "tier"), ident.digest(), budget_bytes=total * 2)
        disk_put, disk_get = _time_put_get(disk, Kind.KV_PAGE, keys, payload)
        # Group commit, as the tiered store's worker writes: batches of 64.
        batched = DiskTier(os.path.join(folder, "batched"), ident.digest(), total * 2)
        t0 = time.perf_counter()
        for i in range(0, len(keys), 64):
            batched.put_many([(k, Kind.KV_PAGE, payload) for k in keys[i : i + 64]])
        disk_put_many = time.perf_counter() - t0
        host = HostTier(total * 2)
        host_put, host_get = _time_put_get(host, Kind.KV_PAGE, keys, payload)

        store = TieredStore(root, 16, 256, host, disk)
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

    print(f"{'path':<15} {'MiB/s':>9} {'vs raw':>7}")
    print(f"{'raw write':<15} {_rate(total, raw_write):>9.0f}")
    print(f"{'files, no fsync':<15} {_rate(total, per_file_write):>9.0f} "
          f"{raw_write / per_file_write:>6.0%}")  # fmt: skip
    print(f"{'disk put':<15} {_rate(total, disk_put):>9.0f} {raw_write / disk_put:>6.0%}")
    print(f"{'disk put_many':<15} {_rate(total, disk_put_many):>9.0f} "
          f"{raw_write / disk_put_many:>6.0%}")  # fmt: skip
    print(f"{'raw read':<15} {_rate(total, raw_read):>9.0f}")
    print(f"{'disk get':<15} {_rate(total, disk_get):>9.0f} {raw_read / disk_get:>6.0%}")
    print(f"{'host put':<15} {_rate(total, host_put):>9.0f} {raw_write / host_put:>6.0%}")
    print(f"{'host get':<15} {_rate(total, host_get):>9.0f} {raw_read / host_get:>6.0%}")
    print(f"lookup of a 4096-token prefix: {lookup * 1e3:.2f} ms")
