"""Traced and lowered stage programs kept on disk from one process to the next.

jax's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`) skips XLA's compile, but not
the trace and the lowering that make its key, and for a model's step those cost a process as
much again. So a step is compiled from a `jax.export` of it: exported once (traced and lowered
to StableHLO), kept in `FLIPJAX_PROGRAM_CACHE` when that names a folder, and compiled from
there by a jit that calls it. A restart, another server on the same model or the next test run
reads the export instead of tracing the model, and jax's cache then has the executable.

A file holds one program and is named by the digest of everything its trace reads: the
binding's key (model config and graph definitions, kernel mode, placement, pool shapes and
dtypes, step shape), the arguments' shapes, dtypes and shardings, the kernel choices in force,
jax's trace-time configuration (matmul precision and the like), the source of every module under
`flipjax/`, `kernels_pallas/` and `sharding/`, the versions of jax, jaxlib and flax, `XLA_FLAGS`,
every `FLIPJAX_*` variable that names no secret or cache folder, and the devices. What cannot
be named stably (an object known only by its address) is not kept.

A file is read only when it is this user's own, in a folder nobody else can write (its program
runs as this process), and only if its arguments are the ones asked for; otherwise the program
is exported anew and the log says why. Writers write a temporary file, fsync it and rename it
into place, so a reader never sees half of one. The processes of a cluster trace the same
programs over the same global devices, so they share files too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
from jax import export
from jax._src import config as jax_config

from flipjax.model.gated_deltanet import GDNState
from flipjax.runtime.cache import GDNSlots, KVPages
from flipjax.runtime.paged import Scores
from kernels_pallas import dispatch, native
from kernels_pallas.matmul import calibration
from kernels_pallas.private_files import kept_file_problem, write_private

log = logging.getLogger(__name__)
CACHE_ENV = "FLIPJAX_PROGRAM_CACHE"  # a folder; unset or "off": nothing kept
_ROOT = Path(__file__).resolve().parents[2]
_TRACED_PACKAGES = ("flipjax", "kernels_pallas", "sharding")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# Variables no trace reads: secrets (never hashed into a name) and other caches' folders.
_UNTRACED_ENV = ("SECRET", "CACHE", "_OWNER", "_DURATIONS", "_RSS")
# Never set while a step is compiled (none is compiled under vmap or a named axis), and known
# only by an object's address.
_UNKEYED_JAX_STATE = ("axis_env_state",)
# The native kernels' custom calls: ours, so an export may hold them (jax.export otherwise
# accepts only custom calls it knows to be stable).
_CUSTOM_CALLS = [export.DisabledSafetyCheck.custom_call(n) for n in native.ffi_names()]

for _tree in (GDNState, GDNSlots, KVPages, Scores):
    export.register_namedtuple_serialization(_tree, serialized_name=f"flipjax.{_tree.__name__}")


def compile_program(
    key: tuple[Any, ...],
    fn: Callable[..., Any],
    jit_options: dict[str, Any],
    args: tuple[Any, ...],
    compiler_options: dict[str, str] | None = None,
) -> Any:
    """`jax.jit(fn, **jit_options).lower(*args).compile(compiler_options)` for the abstract
    `args`, traced only when no export of it is kept under `key` in this trace environment."""
    path = _path(key, args)
    exported = _read(path, args) if path is not None else None
    if exported is None:
        jitted = jax.jit(fn, **jit_options)
        try:
            exported = export.export(jitted, disabled_checks=_CUSTOM_CALLS)(*args)
        except Exception as err:  # what jax.export cannot take compiles as it is
            log.warning(
                "program store: %s cannot be exported (%s); compiling it directly", key[-5:], err
            )
            return jitted.lower(*args).compile(compiler_options)
        if path is not None:
            _write(path, exported)
    return jax.jit(exported.call, **jit_options).lower(*args).compile(compiler_options)


def folder() -> Path | None:
    """The store's folder, or None where it is off."""
    chosen = os.environ.get(CACHE_ENV)
    return None if not chosen or chosen == "off" else Path(chosen)


def _read(path: Path, args: tuple[Any, ...]) -> export.Exported | None:
    if not path.exists():
        return None
    problem = kept_file_problem(path)
    if problem is not None:
        log.warning("program store: %s %s; tracing anew", path, problem)
        return None
    try:
        exported = export.deserialize(bytearray(path.read_bytes()))
    except Exception as err:  # an unreadable or foreign file means: trace it instead
        log.warning("program store: %s unreadable (%s); tracing anew", path, err)
        return None
    flat, tree = jax.tree.flatten((args, {}))  # an export's arguments: (args, kwargs)
    wanted = [(a.shape, a.dtype) for a in flat]
    if exported.in_tree != tree or [(a.shape, a.dtype) for a in exported.in_avals] != wanted:
        log.warning("program store: %s takes other arguments; tracing anew", path)
        return None
    return exported


def _write(path: Path, exported: export.Exported) -> None:
    """Best effort: what cannot be serialized or written is traced again next time."""
    try:
        payload = exported.serialize()
    except Exception as err:  # a tree or feature jax.export cannot serialize
        log.info("program store: %s not kept (%s)", exported.fun_name, err)
        return
    try:
        write_private(path, payload)
    except OSError as err:
        log.info("program store: not kept (%s)", err)


def _path(key: tuple[Any, ...], args: tuple[Any, ...]) -> Path | None:
    """The file of `key` and `args` in the current trace environment; None where the store is
    off or they cannot be named stably."""
    where = folder()
    if where is None:
        return None
    try:
        trace_state = _jax_trace_state()
    except (AttributeError, NotImplementedError) as err:  # a jax without it: nothing is kept
        log.info("program store: jax's trace context unreadable (%s); not kept", err)
        return None
    named = "\n".join(
        (_named(key), repr(args), repr(_kernel_choices()), trace_state, _environment())
    )
    if " at 0x" in named:
        log.info("program store: a program's key names an object by its address; not kept")
        return None
    digest = hashlib.sha256(_sources() + named.encode()).hexdigest()
    return where / f"program-{digest[:40]}.bin"


def _named(key: tuple[Any, ...]) -> str:
    return "(" + ", ".join(_named_part(part) for part in key) + ")"


@functools.lru_cache(maxsize=256)
def _named_part(part: Any) -> str:
    """`repr(part)`, kept: a model's graph definitions take tens of milliseconds to print, and
    every step of a binding shares them."""
    return repr(part)


def _kernel_choices() -> tuple[object, ...]:
    """What `kernels_pallas.dispatch` decides by for a program traced now: the mode, the GDN
    prefill form, and for the native kernels their instruction set and the matmul's choice of
    row counts and builds (this machine's calibration, or `FLIPJAX_NATIVE_MATMUL_ROWS`)."""
    mode = dispatch.current_mode()
    if mode != "native" or not native.available():
        return (mode, dispatch.prefill_form())
    return (mode, dispatch.prefill_form(), calibration.in_force())


def _jax_trace_state() -> str:
    """jax's configuration that tracing reads (what jit itself keys its traces by)."""
    names = jax_config.trace_context_names()
    values = jax_config.trace_context()
    pairs = zip(names, values, strict=True)
    return repr([(n, v) for n, v in pairs if n not in _UNKEYED_JAX_STATE])


def _environment() -> str:
    """The process facts a trace reads, read anew each time (tests and tools set variables
    mid-process)."""
    flipjax_env = sorted(
        (name, value)
        for name, value in os.environ.items()
        if name.startswith("FLIPJAX_") and not any(part in name for part in _UNTRACED_ENV)
    )
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    versions = (sys.version, jax.__version__, jaxlib.__version__, flax.__version__)
    return repr((versions, os.environ.get("XLA_FLAGS", ""), flipjax_env, devices))


@functools.cache
def _sources() -> bytes:
    """The digest of every traced package's source (read once: a process's code is fixed)."""
    digest = hashlib.sha256()
    for package in _TRACED_PACKAGES:
        for path in sorted((_ROOT / package).rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                digest.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.digest()
