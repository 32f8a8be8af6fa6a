"""Timed sweeps span the cache this CPU reports: the largest cache sysfs lists (a fallback when
none can be read), twice that for a sweep, and the copies of a weight that the calibration and
the benchmarks time span it."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

from kernels_pallas import cpu_caches


def _sysfs(root: Path, sizes: dict[str, str]) -> Path:
    for index, size in sizes.items():
        (root / index).mkdir(parents=True)
        (root / index / "size").write_text(size + "\n")
    return root


def test_the_last_level_cache_is_the_largest_one_listed(tmp_path):
    caches = _sysfs(
        tmp_path, {"index0": "48K", "index1": "32K", "index2": "2048K", "index3": "266240K"}
    )
    assert cpu_caches.last_level_cache_bytes(caches) == 266240 << 10
    # An index whose size cannot be read is passed over, not taken as zero or as the answer.
    caches = _sysfs(tmp_path / "b", {"index0": "32M", "index1": "unknown", "index2": "1G"})
    assert cpu_caches.last_level_cache_bytes(caches) == 1 << 30


def test_without_a_readable_cache_the_fallback_is_used(tmp_path):
    assert cpu_caches.last_level_cache_bytes(tmp_path / "absent") == cpu_caches.FALLBACK_BYTES
    caches = _sysfs(tmp_path / "bad", {"index0": "0K", "index1": "-4K", "index2": ""})
    assert cpu_caches.last_level_cache_bytes(caches) == cpu_caches.FALLBACK_BYTES


@pytest.mark.parametrize("text", ["", "K", "12Q", "1.5M", "0"])
def test_a_size_sysfs_would_not_write_is_refused(text):
    with pytest.raises(ValueError, match="cache size"):
        cpu_caches.parse_size(text)


def test_a_sweep_spans_twice_the_cache_and_the_benchmarks_copies_span_the_sweep(monkeypatch):
    monkeypatch.setattr(cpu_caches, "last_level_cache_bytes", lambda: 260 << 20)
    assert cpu_caches.sweep_bytes() == 520 << 20
    monkeypatch.setattr(cpu_caches, "last_level_cache_bytes", lambda: 4 << 20)
    assert cpu_caches.sweep_bytes() == cpu_caches.MIN_SWEEP_BYTES
    monkeypatch.setattr(cpu_caches, "sweep_bytes", lambda: 10 << 20)
    weight = jnp.full((256, 1024), 0.5, jnp.float32)  # 1 MiB
    copies = cpu_caches.uncached_copies(weight)
    assert sum(w.nbytes for w in copies) >= 10 << 20 and len(copies) == 10
    pointers = {w.unsafe_buffer_pointer() for w in copies}
    assert len(pointers) == len(copies), "a copy that shares a buffer is read from cache"
    assert all(bool((w == weight).all()) for w in copies)
