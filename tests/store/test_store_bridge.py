"""The bridge between the engine and the store: an entry that verifies but does not have this
model's payload shape (written by a server with another KV dtype, or by a buggy one that holds
the shared secret) is a counted miss, never an error inside the engine's seeding."""

from __future__ import annotations

import ml_dtypes
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


def test_an_8bit_page_with_a_bad_scale_or_value_is_a_counted_miss():
    """fp8 pages carry their scales: a page whose scale is negative or not finite, or whose
    value is fp8's NaN (no page is ever written with one), is refused as a payload."""
    cfg = tiny_config()
    layout = PayloadLayout.for_model(cfg, PS, "float32", "float8_e4m3fn")
    n = len(TOKENS) // PS
    values = np.ones((n, *layout.kv_shape), np.float32).astype(ml_dtypes.float8_e4m3fn)
    scales = np.full((n, *layout.scale_shape), 0.5, np.float32)
    nan = values.copy()
    nan.view(np.uint8)[1, 0, 0, 0, 0, 0] = 0x7F
    negative, infinite = scales.copy(), scales.copy()
    negative[0, 0, 0, 0], infinite[1, 1, 1, 1] = -0.5, np.inf
    cases = [(values, scales, True), (nan, scales, False), (values, negative, False)]
    for v, s, sound in [*cases, (values, infinite, False)]:
        store = TieredStore(bytes(32), PS, GRID, HostTier(1 << 24))
        bridge = StoreBridge(store, layout, sync_reads=True)
        bridge.publish_pages(TOKENS, 0, HostPages(v, s))
        rec = np.zeros(layout.recurrent_shape, np.float32)
        bridge.publish_state(TOKENS, rec, np.zeros(layout.conv_shape, np.float32))
        store.flush()
        found = bridge.fetch(TOKENS)
        assert (found is not None) == sound
        assert bridge.stats()["store"]["bad_payloads"] == (0 if sound else 1)
        if sound:
            np.testing.assert_array_equal(found.kv.scales, scales)
        store.close()
