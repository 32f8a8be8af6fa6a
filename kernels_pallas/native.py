"""Native CPU kernels: C++ XLA FFI handlers built on first use and registered with XLA.

XLA:CPU has no counterpart of a Pallas kernel, so where a step's XLA form makes many passes over
memory a short C++ handler does the job in one: the GDN decode update, decode attention over
paged K/V, the small-batch matmul, which XLA's GEMM libraries run with a packing pass over the
weight, the experts' grouped matmul, which XLA runs densely against every expert, and the
sampler's first maximum of each row, which XLA takes in three parallel passes. Each
source lives in its operation's folder (`SOURCES`) beside its Python binding; what they share,
the build and load here, the parallel-for of `parallel.h` and the streamed multiply of
`row_panels.h` beside this module, stays at the top of `kernels_pallas` so that no operation's
folder reaches into another's. A source is compiled with the machine's C++ compiler against the
FFI headers jaxlib ships and the shared headers, for this CPU (`-march=native`, or another
instruction set `ISAS` names, so that one machine can test the code paths of others), into a
cache keyed by the source, the headers it may include, the flags, jaxlib's version and the CPU's
features; concurrent builders each write a temporary file and rename it into place, so a reader
never loads half a library. A cached library is loaded only from a folder and a file this user
owns and nobody else can write. Where they cannot be built (no compiler), `available()` says so
and logs why once, and `kernels_pallas.dispatch` runs the pure-JAX references instead. This
module imports nothing from flipjax.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from kernels_pallas.private_files import private_problem

CACHE_ENV = "FLIPJAX_NATIVE_CACHE"
# The instruction set the engine's kernels are built for (one of `ISAS`; default `native`), so a
# machine can run, and be measured on, the code another CPU would run.
ARCH_ENV = "FLIPJAX_NATIVE_ARCH"
PACKAGE = Path(__file__).parent
# Headers every source may include (`#include "parallel.h"`); the include path is this folder.
SHARED_HEADERS = PACKAGE
# Each source by name, in the folder of the operation it implements.
SOURCES = {
    "gdn_decode": PACKAGE / "gdn" / "gdn_decode.cc",
    "conv_pool": PACKAGE / "gdn" / "conv_pool.cc",
    "gated_norm": PACKAGE / "gdn" / "gated_norm.cc",
    "matmul": PACKAGE / "matmul" / "matmul.cc",
    "paged_decode": PACKAGE / "paged_attention" / "paged_decode.cc",
    "ragged_matmul": PACKAGE / "ragged_matmul" / "ragged_matmul.cc",
    "write_rows": PACKAGE / "paged_attention" / "page_writes.cc",
    "first_max": PACKAGE / "sampling" / "first_max.cc",
    "silu_mul": PACKAGE / "pointwise" / "gates.cc",
}
KERNELS = (
    "gdn_decode",
    "conv_pool",
    "gated_norm",
    "matmul",
    "matmul_bf16",
    "matmul_int8",
    "matmuls",
    "matmuls_bf16",
    "paged_decode",
    "paged_decode_bf16",
    "paged_decode_fp8",
    "paged_decode_int8",
    "ragged_matmul",
    "ragged_matmul_bf16",
    "ragged_matmul_int8",
    "write_rows",
    "read_rows",
    "first_max",
    "silu_mul",
    "sigmoid_mul",
)
# handlers that share another kernel's source
SOURCE_OF = {
    "read_rows": "write_rows",
    "sigmoid_mul": "silu_mul",
    "matmul_bf16": "matmul",
    "matmul_int8": "matmul",
    "matmuls": "matmul",
    "matmuls_bf16": "matmul",
    "paged_decode_bf16": "paged_decode",
    "paged_decode_fp8": "paged_decode",
    "paged_decode_int8": "paged_decode",
    "ragged_matmul_bf16": "ragged_matmul",
    "ragged_matmul_int8": "ragged_matmul",
}
# -fno-trapping-math: no code here reads the floating-point exception flags, and without it GCC
# leaves scalar any loop whose branch it cannot run for every lane in case an FP operation
# raises one (it threads the clamp of `fast_exp.h`'s Exp into such a branch): under AVX2, the
# gates' and the gated norm's loops stayed scalar, where AVX-512's masks vectorized them. It
# changes no value: each operation still rounds as IEEE says, in the written order.
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-trapping-math")
# What a kernel is compiled for. A CPU's own (`native`) is the default; the others build the
# code paths of other x86-64 machines here (each runs where the CPU has its features): SSE
# only, no FMA (v2); AVX2 and FMA under the tuning of AMD's Zen, whose compiler heuristics
# avoid FMA chains in loops (v3); AVX-512 (v4).
ISAS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "x86-64-v2": ("-march=x86-64-v2",),
    "x86-64-v3": ("-march=x86-64-v3", "-mtune=znver2"),
    "x86-64-v4": ("-march=x86-64-v4",),
}
# The /proc/cpuinfo flags an instruction set needs to run.
ISA_NEEDS = {
    "native": (),
    "x86-64-v2": ("sse4_2", "popcnt"),
    "x86-64-v3": ("avx2", "fma", "bmi2", "f16c", "movbe"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}

log = logging.getLogger(__name__)


def build_isa() -> str:
    """The instruction set `FLIPJAX_NATIVE_ARCH` names (default `native`): ValueError naming it
    when it is unknown or this CPU cannot run its code."""
    isa = os.environ.get(ARCH_ENV) or "native"
    if isa not in ISAS:
        raise ValueError(f"{ARCH_ENV}: unknown instruction set {isa!r}; one of {sorted(ISAS)}")
    if not runs_here(isa):
        raise ValueError(f"{ARCH_ENV}={isa}: this CPU lacks some of {ISA_NEEDS[isa]}")
    return isa


@functools.cache
def available() -> bool:
    """Whether every native kernel builds and loads here (the reason it does not is logged)."""
    try:
        for name in KERNELS:
            target(name)
    except (OSError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable, the pure-JAX references run instead: %s", e)
        return False
    return True


def target(name: str, isa: str | None = None) -> str:
    """The FFI target `flipjax_<name>` (handler `Flipjax<Name>`; `flipjax_<name>_<isa>` for
    another instruction set than the CPU's own), built for `isa` (default: `build_isa()`) from
    the source `SOURCES` gives for `name` (or for the name `SOURCE_OF` gives) and registered on
    first use."""
    return _target(name, isa or build_isa())


@functools.cache
def _target(name: str, isa: str) -> str:
    library = ctypes.cdll.LoadLibrary(str(build(SOURCE_OF.get(name, name), isa)))
    symbol = "Flipjax" + "".join(part.title() for part in name.split("_"))
    ffi_name = _ffi_name(name, isa)
    jax.ffi.register_ffi_target(
        ffi_name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
    )
    return ffi_name


def _ffi_name(name: str, isa: str) -> str:
    return f"flipjax_{name}" if isa == "native" else f"flipjax_{name}_{isa.replace('-', '_')}"


def ffi_names() -> tuple[str, ...]:
    """Every FFI target name these kernels can be registered under (each kernel, each
    instruction set), whether built here or not."""
    return tuple(_ffi_name(name, isa) for name in KERNELS for isa in ISAS)


def build(name: str, isa: str = "native") -> Path:
    """Compile the source `SOURCES[name]` for the instruction set `isa` (once per source,
    headers, flags, jaxlib and CPU); the library's path. A library found in the cache is
    loaded only if it is a plain file that this user owns and nobody else can write, in a
    folder nobody else can write: a planted library would run as this process (RuntimeError
    otherwise)."""
    library, flags, compiler = _library_path(name, isa)
    folder = library.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(folder, "folder")
    if os.path.lexists(library):
        _check_private(library, "library")
        return library
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        include = ["-isystem", jax.ffi.include_dir(), "-I", str(SHARED_HEADERS)]
        command = [compiler, *flags, *include, str(SOURCES[name]), "-o", partial]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        os.chmod(partial, 0o755)
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def _library_path(name: str, isa: str) -> tuple[Path, tuple[str, ...], str]:
    """Where the library of `name` for `isa` is cached (named by the key of everything that
    goes into it), with the flags and the compiler that build it."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}: one of {sorted(ISAS)}")
    flags = (*FLAGS, *ISAS[isa])
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in _headers(SOURCES[name])]
    facts = (" ".join(flags), jaxlib.__version__, compiler, _cpu_features())
    for part in (SOURCES[name].read_bytes(), *headers, *(f.encode() for f in facts)):
        key.update(part)
    return _cache_folder() / f"{name}-{key.hexdigest()[:16]}.so", flags, compiler


def _headers(source: Path) -> list[Path]:
    """Every header `source` may include: the shared ones and any beside it in its own folder,
    so that a change to either builds a new library."""
    return sorted({*SHARED_HEADERS.glob("*.h"), *source.parent.glob("*.h")})


def cached_beside(name: str, isa: str, suffix: str) -> Path:
    """A path in the cache named by the same key as the library of `name` built for `isa`, so
    that what is measured of a build (`matmul.calibration`) is cached with it, and a new build
    measures again."""
    library = _library_path(name, isa)[0]
    return library.with_name(library.stem + suffix)


def _check_private(path: Path, what: str) -> None:
    """RuntimeError naming `path` unless it is this user's own, not a link, and writable by
    nobody else."""
    problem = private_problem(path, what)
    if problem is not None:
        raise RuntimeError(
            f"native kernel cache: {path} {problem}; refusing to load kernels from it "
            f"(remove it, or point {CACHE_ENV} at a private folder)"
        )


def runs_here(isa: str) -> bool:
    """Whether this CPU has the features code built for `isa` needs."""
    flags = cpu_flags()
    return all(need in flags for need in ISA_NEEDS[isa])


def cpu_flags() -> set[str]:
    """This CPU's feature flags, as /proc/cpuinfo names them (empty where it cannot be read)."""
    flags = set()
    for line in _cpu_features().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return flags


def _cache_folder() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flipjax" / "native"


@functools.cache  # asked at every kernel lookup (via `build_isa`); a CPU does not change
def _cpu_features() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
