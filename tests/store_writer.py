"""A writer process for the crash-safety test: puts entries until it is killed."""

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
    start = int(sys.argv[2])
    print("ready", flush=True)
    for i in range(start, start + 100_000):
        key = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
        tier.put(key, Kind.KV_PAGE, payload_for(key))


if __name__ == "__main__":
    main()
