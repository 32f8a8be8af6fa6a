"""llama.cpp as a peer of `python -m flipjax.bench engine --peer llama.cpp`.

llama.cpp is the engine a CPU user would otherwise pick, so the bench runs its own batched
bench (`llama-batched-bench`) on the bench's checkpoint, converted by its own converter
(`convert_hf_to_gguf.py`). Both come from the llama.cpp sources vendored in the
`llama-cpp-python` source distribution on the package index, downloaded and built once into a
cache (`FLIPJAX_LLAMA_CPP_CACHE`, default `~/.cache/flipjax/llama.cpp/<version>`); every step
writes beside its target and renames into place, so a half-done build is never used. It needs
cmake and a C++ compiler, which `make test`'s install does not bring: it is an optional extra.

The converter needs a tokenizer it recognises, and the bench's random checkpoints have none:
`llama_cpp_tokenizer` rebuilds one from llama.cpp's own files. Anything that fails (no
compiler, no download, a checkpoint the converter refuses) raises `Unavailable` with the reason,
which the bench prints before running the rest; no number is ever made up.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flipjax.benchmarks.llama_cpp_tokenizer import TOKENIZER_SIZE, write_tokenizer

VERSION = "0.3.36"  # of llama-cpp-python, whose sdist vendors llama.cpp's sources
CACHE_ENV = "FLIPJAX_LLAMA_CPP_CACHE"


@dataclass(frozen=True)
class PeerRates:
    prefill_tok_s: float
    decode_tok_s: float


class Unavailable(RuntimeError):
    """A step llama.cpp's peer run needs could not be done; the message says which and why."""


@dataclass(frozen=True)
class LlamaCppBench:
    """llama.cpp's batched bench, built, with the checkpoint converted: `rates` runs it."""

    binary: Path
    model: Path
    threads: int
    build: str  # what runs, for the bench's report

    def rates(
        self, batches: list[int], prompt_len: int, decode_tokens: int
    ) -> dict[int, PeerRates]:
        """Prefill and decode rates for each batch size, each batch being independent sequences
        of `prompt_len` prompt and `decode_tokens` generated tokens (as transformers' and
        flipjax's batches are). Unavailable, with llama.cpp's last line, where it fails."""
        command = [
            str(self.binary),
            "-m",
            str(self.model),
            "-c",
            str(max(batches) * (prompt_len + decode_tokens) + 64),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(prompt_len),
            "-ntg",
            str(decode_tokens),
            "-npl",
            ",".join(map(str, batches)),
            "-t",
            str(self.threads),
            "--output-format",
            "jsonl",
        ]
        return parse_batched_bench(_run(command, "llama-batched-bench").stdout)


def prepare_llama_cpp(
    checkpoint: Path, threads: int, dtype: str = "float32", quantization: str | None = None
) -> LlamaCppBench:
    """llama.cpp built (once, cached) and `checkpoint` converted to its weights in
    `gguf_type(dtype, quantization)`, to run on `threads` threads; Unavailable, saying which
    step failed and why, where it cannot be."""
    cache = _cache()
    for tool in ("cmake", "c++"):  # before any download
        if shutil.which(tool) is None and not (cache / "llama-batched-bench").exists():
            raise Unavailable(f"building llama.cpp needs {tool} (apt-get install cmake g++)")
    source = _sources(cache)
    binary = _binary(source, cache)
    outtype = gguf_type(dtype, quantization)
    model = _gguf(checkpoint, source, cache, outtype)
    build = f"llama.cpp from llama-cpp-python {VERSION}, {outtype} GGUF"
    return LlamaCppBench(binary, model, threads, build)


def gguf_type(dtype: str, quantization: str | None) -> str:
    """The converter's `--outtype` for flipjax's weights: f32 or bf16, and for int8 weights
    llama.cpp's own int8, Q8_0 (a scale per 32 weights where flipjax keeps one per channel)."""
    if quantization == "int8":
        return "q8_0"
    return "f32" if dtype == "float32" else "bf16"


def parse_batched_bench(text: str) -> dict[int, PeerRates]:
    """Rates per batch size from `llama-batched-bench --output-format jsonl`: S_PP and S_TG.
    ValueError naming the problem on output it cannot read."""
    rates: dict[int, PeerRates] = {}
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
            rates[int(row["pl"])] = PeerRates(float(row["speed_pp"]), float(row["speed_tg"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"llama-batched-bench: unreadable row {line[:120]!r}: {e}") from e
    if not rates:
        raise ValueError("llama-batched-bench: no result rows in its output")
    return rates


def _cache() -> Path:
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "flipjax" / "llama.cpp"
    folder = Path(base) / VERSION
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _run(command: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(command, capture_output=True, text=True, **kw)
    except FileNotFoundError as e:
        raise Unavailable(f"{what}: {e.filename} is not installed") from e
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise Unavailable(f"{what} failed (exit {done.returncode}): {last[0][:300]}")
    return done


def _sources(cache: Path) -> Path:
    """llama.cpp's sources from the sdist, downloaded and unpacked once."""
    target = cache / "src"
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    f"llama-cpp-python=={VERSION}",
                    "--no-binary",
                    ":all:",
                    "--no-deps",
                    "-d",
                    tmp,
                ],
                "downloading the llama-cpp-python sdist",
            )
            (archive,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(archive) as tar:
                tar.extractall(Path(tmp) / "x", filter="data")
            (unpacked,) = (Path(tmp) / "x").iterdir()
            os.replace(unpacked / "vendor" / "llama.cpp", tmp + "/llama.cpp")
            os.replace(tmp + "/llama.cpp", target)
    return target


def _binary(source: Path, cache: Path) -> Path:
    """`llama-batched-bench`, built once (statically, so the file stands alone)."""
    target = cache / "llama-batched-bench"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache) as build:
        _run(
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                build,
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
            ],
            "configuring llama.cpp",
        )
        jobs = str(os.cpu_count() or 1)
        _run(
            ["cmake", "--build", build, "--target", "llama-batched-bench", "-j", jobs],
            "building llama-batched-bench",
        )
        os.replace(Path(build) / "bin" / "llama-batched-bench", target)
    return target


def _gguf(checkpoint: Path, source: Path, cache: Path, outtype: str) -> Path:
    """The checkpoint converted by llama.cpp's converter (once per checkpoint content)."""
    key = hashlib.sha256(outtype.encode())
    for path in sorted(checkpoint.iterdir()):
        if path.is_file():
            key.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 24), b""):
                    key.update(block)
    target = cache / "gguf" / f"{key.hexdigest()[:16]}-{outtype}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(exist_ok=True)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    if vocab < TOKENIZER_SIZE:
        raise Unavailable(
            f"llama.cpp's converter needs a tokenizer it recognises; the one the bench can build "
            f"has {TOKENIZER_SIZE} ids, more than this checkpoint's vocabulary of {vocab}"
        )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        for path in checkpoint.iterdir():  # the caller's folder is never written
            (folder / path.name).symlink_to(path.resolve())
        write_tokenizer(folder, source)
        out = Path(tmp) / "model.gguf"
        env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
        _run(
            [
                sys.executable,
                str(source / "convert_hf_to_gguf.py"),
                str(folder),
                "--outtype",
                outtype,
                "--outfile",
                str(out),
                "--no-mtp",
            ],
            "llama.cpp's converter",
            env=env,
        )
        os.replace(out, target)
    return target
