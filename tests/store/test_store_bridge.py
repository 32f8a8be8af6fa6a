"""The bridge between the engine and the store: an entry that verifies but does not have this
model's payload shape (written by a server with another KV dtype, or by a buggy one that holds
the shared secret) is a counted miss, never an error inside the engine's seeding."""

from __future__ import annotations

import numpy as np

from flipjax.model.tiny import tiny_config
from flipjax.runtime.host_pages import HostPages
from store.bridge import StoreBridge
from store.host import HostTier
from store.payload import PayloadLayout, numpy_dtype
from store.tiered import TieredStore

PS, GRID = 4, 8
TOKENS = list(range(2 * GRID))


def _publish(bridge: StoreBridge) -> None:
    layout = bridge.layout
    pages = np.zeros((len(TOKENS) // PS, *layout.kv_shape), numpy_dtype(layout.kv_dtype))
    bridge.publish_pages(TOKENS, 0, HostPages(pages))
    rec = np.zeros(layout.recurrent_shape, np.float32)
    bridge.publish_state(TOKENS, rec, np.zeros(layout.conv_shape, numpy_dtype(layout.kv_dtype)))
    bridge.store.flush()


def test_a_payload_of_another_shape_is_a_counted_miss():
    cfg = tiny_config()
    store = TieredStore(bytes(32), PS, GRID, HostTier(1 << 24))
    ours = StoreBridge(store, PayloadLayout.for_model(cfg, PS, "float32"), sync_reads=True)
    other = StoreBridge(store, PayloadLayout.for_model(cfg, PS, "bfloat16"), sync_reads=True)
    _publish(other)  # the same keys, half the bytes per value
    assert ours.fetch(TOKENS) is None
    assert ours.stats()["store"]["bad_payloads"] == 1
    assert other.fetch(TOKENS).tokens == len(TOKENS)  # the entries themselves are sound
    store.close()
