"""A checkpoint's tensors read by rows at an offset: the values safetensors itself reads, in
every float dtype and block size; a range that does not fit the file refused; and the point of
it, a large tensor read without its file pages staying resident."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from flipjax.model import tensor_rows
from flipjax.model.weights import _Reader
from tests.support.servers import ROOT


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("rows_per_block", [1, 7, 64, 1000])
def test_blocks_are_the_rows_safetensors_reads(tmp_path, dtype, rows_per_block):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((64, 5, 3)).astype(dtype),
        "b": rng.standard_normal((13, 9)).astype(dtype),
    }
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    for name in tensors:
        rows = tensor_rows.open_rows(path, name)
        got = np.concatenate([b.copy() for _, b in rows.blocks(rows_per_block)])
        with safe_open(path, framework="np") as f:
            want = f.get_tensor(name)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_read_into_casts_and_transposes_and_other_dtypes_take_the_library_path(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 40)).astype(np.float32)
    ids = np.arange(60, dtype=np.int32).reshape(6, 10)
    path = str(tmp_path / "w.safetensors")
    save_file({"w": w, "ids": ids}, path)
    reader = _Reader({"w": path, "ids": path})
    out = np.empty((40, 300), ml_dtypes.bfloat16)
    reader.read_into("w", out, transpose=True)
    assert np.array_equal(out, w.T.astype(ml_dtypes.bfloat16))
    assert tensor_rows.open_rows(path, "ids") is None
    got = np.empty((6, 10), np.int32)
    reader.read_into("ids", got)
    assert np.array_equal(got, ids)


def _rewrite_header(path: str, change) -> None:
    data = open(path, "rb").read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))  # the same length, so the data stays where it was
    assert len(text) == length
    with open(path, "wb") as f:
        f.write(data[:8] + text + data[8 + length :])


@pytest.mark.parametrize(
    "damage", ["short_range", "past_the_end", "truncated_file", "header", "no_offsets", "empty"]
)
def test_a_range_that_does_not_fit_is_refused(tmp_path, damage):
    path = str(tmp_path / "w.safetensors")
    save_file({"w": np.ones((8, 4), np.float32), "pad": np.zeros(64, np.float32)}, path)
    if damage == "short_range":
        _rewrite_header(path, lambda h: h["w"].update(data_offsets=[0, 64]))
    elif damage == "past_the_end":
        _rewrite_header(path, lambda h: h["w"].update(shape=[80, 4], data_offsets=[0, 1280]))
    elif damage == "no_offsets":
        _rewrite_header(path, lambda h: h["w"].pop("data_offsets"))
    elif damage == "empty":
        open(path, "wb").close()
    elif damage == "truncated_file":
        data = open(path, "rb").read()
        (length,) = struct.unpack("<Q", data[:8])
        offsets = json.loads(data[8 : 8 + length])["w"]["data_offsets"]
        with open(path, "wb") as f:
            f.write(data[: 8 + length + offsets[1] - 1])
    else:
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError):
        rows = tensor_rows.open_rows(path, "w")
        for _ in rows.blocks(3):
            pass


_PEAK = """
import sys, threading
import ml_dtypes, numpy as np
from flipjax.benchmarks.memory import rss_bytes
from flipjax.model.weights import _Reader
out = np.full((8192, 2048), 2.0, ml_dtypes.bfloat16)  # 32 MiB, touched before the start
start = peak = rss_bytes()
stop = threading.Event()
def sample():
    global peak
    while not stop.wait(0.001):
        peak = max(peak, rss_bytes())
thread = threading.Thread(target=sample)
thread.start()
_Reader({"w": sys.argv[1]}).read_into("w", out)
stop.set()
thread.join()
print(max(peak, rss_bytes()) - start)
"""


def test_a_large_tensor_is_read_without_holding_its_file_pages(tmp_path):
    """64 MiB of fp32 read into bf16: the growth is the read's own buffer (16 MiB of fp32),
    not the file's pages (64 MiB through a memory map)."""
    path = str(tmp_path / "w.safetensors")
    save_file({"w": np.ones((8192, 2048), np.float32)}, path)
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, path], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    grew = int(done.stdout.split()[-1])
    assert grew < 32 << 20, f"the read grew RSS by {grew >> 20} MiB"
