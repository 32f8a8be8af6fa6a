"""A writer process for the crash-safety test: puts entries (one by one, or in group-committed
batches) until it is killed."""

import hashlib
import sys

from store.disk import DiskTier
from store.entry import Kind

IDENTITY = b"\x07" * 32


def payload_for(key: bytes) -> bytes:
    """Deterministic payload of 1-200 KiB, so a reader can tell right bytes from wrong."""
    size = 1024 * (1 + key[0] % 200)
    block = hashlib.blake2b(key, digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def main() -> None:
    tier = DiskTier(sys.argv[1], IDENTITY, budget_bytes=1 << 40)
    start, batch = int(sys.argv[2]), int(sys.argv[3])
    print("ready", flush=True)
    for i in range(start, start + 100_000, batch):
        keys = [
            hashlib.blake2b(j.to_bytes(8, "little"), digest_size=32).digest()
            for j in range(i, i + batch)
        ]
        if batch == 1:
            tier.put(keys[0], Kind.KV_PAGE, payload_for(keys[0]))
        else:
            tier.put_many([(k, Kind.KV_PAGE, payload_for(k)) for k in keys])


if __name__ == "__main__":
    main()
