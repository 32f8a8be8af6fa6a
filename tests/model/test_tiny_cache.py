"""`tiny`'s weights kept on disk: read back exactly, made anew (and rewritten) when a file does
not match or cannot be trusted, and keyed so that another dtype or changed model code never
reads a file made for something else."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flipjax.model import tiny, tiny_cache

SHAPES = [((3, 4), np.float32), ((5,), ml_dtypes.bfloat16), ((2, 2), np.int32)]


def _abstract() -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(s, d) for s, d in SHAPES]


def _leaves(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 100).astype(d) for s, d in SHAPES]


class Maker:
    def __init__(self, seed: int = 0):
        self.seed, self.calls = seed, 0

    def __call__(self) -> list[np.ndarray]:
        self.calls += 1
        return _leaves(self.seed)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def folder(tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    monkeypatch.setenv(tiny_cache.CACHE_ENV, str(folder))
    return folder


def test_a_second_call_reads_the_file_bit_for_bit(folder):
    first = Maker()
    made = tiny_cache.cached_leaves("float32", 0, _abstract(), first)
    assert first.calls == 1
    assert len(list(folder.glob("tiny-float32-*.npz"))) == 1
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no partial left
    again = Maker(seed=99)  # would make other numbers: the file's must come back
    read = tiny_cache.cached_leaves("float32", 0, _abstract(), again)
    assert again.calls == 0
    assert _same(read, made)


def test_another_dtype_seed_or_model_source_is_another_file(folder, tmp_path, monkeypatch):
    tiny_cache.cached_leaves("float32", 0, _abstract(), Maker())
    for dtype, seed in (("bfloat16", 0), ("float32", 1)):
        other = Maker(seed=5)
        tiny_cache.cached_leaves(dtype, seed, _abstract(), other)
        assert other.calls == 1, (dtype, seed)
    sources = tmp_path / "sources"
    sources.mkdir()
    for p in tiny_cache._SOURCES.glob("*.py"):
        (sources / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(tiny_cache, "_SOURCES", sources)
    unchanged = Maker(seed=5)
    tiny_cache.cached_leaves("float32", 0, _abstract(), unchanged)
    assert unchanged.calls == 0
    with open(sources / "tiny.py", "a") as f:
        f.write("\n# an initializer changed\n")
    changed = Maker(seed=5)
    tiny_cache.cached_leaves("float32", 0, _abstract(), changed)
    assert changed.calls == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage", "shape", "width", "extra", "missing"])
def test_a_file_that_does_not_match_is_made_anew_and_rewritten(folder, damage):
    tiny_cache.cached_leaves("float32", 0, _abstract(), Maker())
    (path,) = folder.glob("*.npz")
    good = _leaves(0)
    bits = {f"w{i}": x.view(f"u{x.dtype.itemsize}") for i, x in enumerate(good)}
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "garbage":
        path.write_bytes(b"not a zip file at all" * 10)
    else:
        if damage == "shape":
            bits["w0"] = bits["w0"].reshape(4, 3)
        elif damage == "width":  # the bfloat16 leaf's 16-bit words widened to 32
            bits["w1"] = bits["w1"].astype(np.uint32)
        elif damage == "extra":
            bits["w9"] = bits["w0"]
        else:
            del bits["w2"]
        with open(path, "wb") as f:
            np.savez(f, **bits)
    remade = Maker(seed=7)
    got = tiny_cache.cached_leaves("float32", 0, _abstract(), remade)
    assert remade.calls == 1 and _same(got, _leaves(7))
    later = Maker(seed=8)
    assert _same(tiny_cache.cached_leaves("float32", 0, _abstract(), later), _leaves(7))
    assert later.calls == 0


def test_a_file_others_can_write_is_not_read(folder):
    tiny_cache.cached_leaves("float32", 0, _abstract(), Maker())
    (path,) = folder.glob("*.npz")
    os.chmod(path, 0o666)
    planted = Maker(seed=3)
    assert _same(tiny_cache.cached_leaves("float32", 0, _abstract(), planted), _leaves(3))
    assert planted.calls == 1


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(tiny_cache.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for _ in range(2):
        made = Maker()
        tiny_cache.cached_leaves("float32", 0, _abstract(), made)
        assert made.calls == 1
    assert not list(tmp_path.rglob("*.npz"))


def test_tiny_from_its_file_equals_tiny_made_anew(folder, monkeypatch):
    """The real model: the weights a later process reads are the ones the initializers make."""
    dtype = jnp.dtype(jnp.bfloat16).name  # the narrower dtype: 16-bit views must round-trip
    made_by = Maker()
    make = tiny._make_leaves

    def counted(d: str) -> list[np.ndarray]:
        made_by.calls += 1
        return make(d)

    monkeypatch.setattr(tiny, "_make_leaves", counted)
    tiny._tiny_weights.cache_clear()
    try:
        _, _, kept = tiny._tiny_weights(dtype)  # made and written
        tiny._tiny_weights.cache_clear()
        _, _, read = tiny._tiny_weights(dtype)  # read
    finally:
        tiny._tiny_weights.cache_clear()
    assert made_by.calls == 1
    made = make(dtype)
    assert len(list(folder.glob(f"tiny-{dtype}-*.npz"))) == 1
    assert _same(list(read), made) and _same(list(kept), made)
