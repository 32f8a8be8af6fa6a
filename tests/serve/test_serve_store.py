"""The server's prefix reuse: a repeated prompt is served from the device cache, after
`/flush_cache` from the store's host tier, and after a restart over the same `--store-dir` from
disk, with identical greedy output each time; the disk tier can be resized, detached and
attached again while serving."""

from __future__ import annotations

import logging

from serve.metrics import TIERS
from tests.support.http import HTTP
from tests.support.prompts import STORE_PROMPT as PROMPT
from tests.support.servers import INSECURE_ADMIN, SMALL, metric, start_server, stop_server


def complete(base: str, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    r = HTTP.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def hits(base: str) -> dict[str, float]:
    """Admissions served from each tier so far, and misses, from `/metrics`."""
    found = {t: metric(base, f'flipjax:prefix_hits_total{{tier="{t}"}}') for t in TIERS}
    return {**found, "misses": metric(base, "flipjax:prefix_misses_total")}


def test_prefix_hits_from_device_host_and_disk(tmp_path):
    # A queued request waits for its stored prefix however loaded the machine is.
    flags = (
        *("--store-dir", str(tmp_path / "store"), "--gdn-checkpoint-interval", "32", *SMALL),
        *(INSECURE_ADMIN, "--prefetch-wait-ms", "30000"),
    )
    with open(tmp_path / "a.txt", "w") as log:
        proc, base = start_server(log, *flags)
    try:
        cold = complete(base)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert hits(base) == {"device": 0, "host": 0, "disk": 0, "remote": 0, "misses": 1}
        for tier in ("device", "host"):
            if tier == "host":
                r = HTTP.post(f"{base}/flush_cache", timeout=30)
                assert r.status_code == 200 and r.json()["flushed"]["states"] > 0
            warm = complete(base)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
            assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
            assert hits(base)[tier] == 1, tier
    finally:
        stop_server(proc)

    with open(tmp_path / "b.txt", "w") as log:
        proc, base = start_server(log, *flags)
    try:
        again = complete(base)  # a fresh device and host tier: this hit can only come from disk
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert again["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        assert hits(base) == {"device": 0, "host": 0, "disk": 1, "remote": 0, "misses": 0}
        route = f"{base}/hicache/storage-backend"
        state = HTTP.get(route, timeout=30).json()
        assert state["disk"]["used_bytes"] > 0
        assert state["counters"]["disk"]["hits"] >= 3  # two pages and the anchor
        folder = state["disk"]["dir"]

        r = HTTP.post(f"{base}/hicache/clear", json={"remote": True}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "remote"
        r = HTTP.post(f"{base}/hicache/clear", json={}, timeout=60)
        assert r.status_code == 200, r.text
        cleared = r.json()
        assert cleared["cleared"]["host"]["removed"] > 0
        # 97 tokens computed (90 of prompt, 7 generated): six pages, anchors at 32, 64 and 96
        assert cleared["cleared"]["disk"] == {"removed": 9, "kept_pinned": 0}
        assert cleared["disk"]["used_bytes"] == 0 and cleared["disk"]["footprint_bytes"] == 0
        assert HTTP.post(f"{base}/flush_cache", timeout=30).status_code == 200
        cold_again = complete(base)  # nothing holds the prefix now: computed, the same tokens
        assert cold_again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold_again["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]

        r = HTTP.post(f"{route}/resize", json={"disk_gb": 1e-9}, timeout=30)  # ~1 byte: evict
        assert r.status_code == 200 and r.json()["disk"]["used_bytes"] == 0
        assert HTTP.delete(route, timeout=30).json()["disk"] is None
        r = HTTP.delete(route, timeout=30)
        assert r.status_code == 409 and "no disk tier" in r.json()["error"]["message"]
        r = HTTP.post(f"{route}/resize", json={"disk_gb": 1}, timeout=30)
        assert r.status_code == 409
        outside = tmp_path.parent / f"{tmp_path.name}-outside"  # beside --store-dir's parent
        (outside / "entries").mkdir(parents=True)
        (outside / "entries" / "notes.txt").write_text("not the store's")
        r = HTTP.put(route, json={"disk_gb": 1, "dir": str(outside)}, timeout=30)
        assert r.status_code == 400 and "not under --store-root" in r.json()["error"]["message"]
        assert (outside / "entries" / "notes.txt").read_text() == "not the store's"
        r = HTTP.put(route, json={"disk_gb": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["disk"]["dir"] == folder
        r = HTTP.put(route, json={"disk_gb": 1}, timeout=30)
        assert r.status_code == 409 and "attached already" in r.json()["error"]["message"]
        r = HTTP.put(route, json={"disk_gb": -1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "disk_gb"

        # A tenant's salt: the prefix cached without one (or with another) is not its own.
        for salt, cached in [("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 64)]:
            salted = complete(base, cache_salt=salt)
            assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, salt
            assert salted["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "cache_salt": ""}
        r = HTTP.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    finally:
        stop_server(proc)


def test_store_flags_reach_the_tiers(tmp_path):
    from flipjax.serve import _open_store, parse_args

    config = parse_args(
        ["--store-dir", str(tmp_path), "--disk-min-free-gb", "0.5"]
        + ["--disk-cache-gb", "1", "--prefetch-wait-ms", "250"]
    )
    bridge, _, control = _open_store(config, logging.getLogger("test"))
    assert bridge.store.disk.min_free_bytes == control.min_free_bytes == 2**29
    assert bridge.store.remote is None and config.cache.prefetch_wait_s == 0.25
    bridge.store.close()


def test_weights_quantized_at_load_and_8bit_kv_are_other_models_to_the_store(tmp_path):
    """KV computed with int8 weights is never served to the unquantized model, or back; nor KV
    pages of one KV dtype to a server of another (fp8 and its alias are one dtype)."""
    from flipjax.serve import _open_store, parse_args

    folders, dtypes = [], []
    runs = [[], ["--quantization", "int8"], ["--kv-cache-dtype", "fp8"]]
    for extra in [*runs, ["--kv-cache-dtype", "fp8_e4m3"], ["--kv-cache-dtype", "int8"]]:
        config = parse_args(["--store-dir", str(tmp_path), "--disk-cache-gb", "1", *extra])
        bridge, _, _ = _open_store(config, logging.getLogger("test"))
        folders.append((bridge.store.disk.root, bridge.store.disk.identity))
        dtypes.append(bridge.dtypes[1])
        bridge.store.close()
    assert len(set(folders)) == 4 and folders[2] == folders[3]
    assert dtypes == ["float32", "float32", "float8_e4m3fn", "float8_e4m3fn", "int8"]
