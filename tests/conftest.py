"""Test session setup: 8 virtual CPU devices, fp32 matmuls, cheap compiles, bounded tests.

XLA_FLAGS must be set before jax is first imported, which is why it happens at module import.

Why the suite once hung, and the guards against it. A worker kept every program it compiled,
about twenty memory mappings each, until it reached the kernel's vm.max_map_count; the next
compile (or persistent-cache serialization) failed, unwinding its C++ exception faulted in the
unwinder, and the SIGSEGV handler of xgrammar's apache-tvm-ffi deadlocked on the unwinder's lock.
Now a worker drops its programs between files when it nears the limit (below), a fault ends
its process with a report (`flipjax.runtime.fault_handlers`), and every test is bounded.

One persistent compilation cache serves the run, and the runs after it on the same machine:
the controlling process chooses the folder, and the workers and every server or cluster
process they start share it, so a program compiled by one of them is loaded by the others, and
a program no change touched is loaded, not compiled, by the next run (jax keys each entry by
the program, the jax and XLA versions, the flags and the devices). It caches every program,
however quick to compile (the suite measured 504 s against 610 s with a 0.5 s floor, back to
back on one machine), and has no size bound, under which jax would take a file lock and rescan
the folder on each write (that cost 35%); the kept folder is emptied past `_KEPT_CACHE_LIMIT`
instead. `FLIPJAX_TEST_XLA_CACHE=run` compiles everything anew in a folder of the run's own.
`test_compile_counter.py` checks the cache's accounting in a process of its own. Beside it,
the program store (`flipjax.runtime.program_store`) keeps the traced stage programs in
`test-program-store`, so a step no source change touched is not traced again either (a test
file of engines: 50 s -> 40 s).
"""

import atexit
import faulthandler
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    # Tests compile many small programs and run each a few times: cheaper compiles win (-25%).
    + " --xla_backend_optimization_level=0"
    # XLA:CPU's older elemental emitters compile the tiny model's steps in 40% less time (an
    # engine's warmup: 18.0 -> 10.9 s of backend compiles), with the same tokens.
    + " --xla_cpu_use_fusion_emitters=false"
    # XLA:CPU splits each program's LLVM module into parts compiled on parallel threads; the
    # tiny model's programs are small, and two workers on two cores leave no core for the
    # parts. In one piece, four engine test files compiled from nothing in 102-108 s against
    # 118-137 s (two workers, alternating runs), with the same tokens.
    + " --xla_cpu_parallel_codegen_split_count=1"
    # Eight virtual devices share two cores, so a device can reach a collective long after the
    # others; XLA aborts the process when a rendezvous waits past this (40 s by default, which
    # a loaded two-core machine can exceed). A stuck test is ended by its timeout first.
    + " --xla_cpu_collective_call_terminate_timeout_seconds=900"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Which products the native matmul takes is measured per machine (kernels_pallas/matmul/
# calibration.py); the suite pins it, so that every machine routes the same products to the
# kernel and checks the same programs. test_matmul_calibration.py checks the measuring.
os.environ.setdefault("FLIPJAX_NATIVE_MATMUL_ROWS", "float32=2-32,bfloat16=1-8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Past this size the kept cache is emptied before a run (jax's own bound costs 35%, above).
_KEPT_CACHE_LIMIT = 8 << 30


def _kept_cache(name: str) -> str:
    """The machine's cache folder `name` kept from run to run (FLIPJAX_TEST_XLA_CACHE names
    another for jax's; `run` asks for fresh ones this run removes: every program traced and
    compiled anew)."""
    chosen = os.environ.get("FLIPJAX_TEST_XLA_CACHE")
    if chosen == "run":
        folder = tempfile.mkdtemp(prefix=f"flipjax-{name}-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return folder
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = (chosen if name == "test-xla-cache" else None) or os.path.join(base, "flipjax", name)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    held = sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
    if held > _KEPT_CACHE_LIMIT:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    return folder


if os.environ.get("FLIPJAX_TEST_XLA_CACHE_OWNER") is None:
    _cache = _kept_cache("test-xla-cache")
    os.environ["FLIPJAX_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # The traced steps too (`flipjax.runtime.program_store`): a step no change touched is
    # neither traced nor compiled again, by this run's other workers or the next run.
    os.environ.setdefault("FLIPJAX_PROGRAM_CACHE", _kept_cache("test-program-store"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

from flipjax.runtime import program_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# pytest-timeout fails a test that outlives its timeout by raising in its main thread (SIGALRM),
# which leaves the worker alive for the rest of the run. A test stuck inside C code never sees
# that signal: past its timeout and a grace, its native and Python stacks are printed and the
# worker exits, which ends the run (`--max-worker-restart=0` in the Makefile: xdist's whole-
# file scheduling can deadlock when it replaces a crashed worker).
_HARD_EXIT_GRACE_S = 30
_terminal: list[int] = []  # a copy of stderr made before pytest captures it


# Each test file runs whole on one worker (`--dist loadfile`). Started in the order of their
# seconds in `durations.json` (measured; longest first, unlisted files last), a long file never
# starts last beside an idle worker (`--no-loadscope-reorder` keeps this order).
_DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")


# With FLIPJAX_TEST_DURATIONS=<file>, the controlling process (which xdist's workers send every
# report to) appends `<file> <seconds>` per test phase; `make test-durations` sums them into
# `durations.json`.
_DURATIONS_LOG = os.environ.get("FLIPJAX_TEST_DURATIONS")
if "PYTEST_XDIST_WORKER" in os.environ:
    _DURATIONS_LOG = None  # the controller logs the same report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _DURATIONS_LOG:
        with open(_DURATIONS_LOG, "a") as f:
            f.write(f"{report.nodeid.split('::')[0]} {report.duration:.3f}\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    with open(_DURATIONS) as f:
        seconds = json.load(f)
    root = os.path.dirname(os.path.dirname(__file__))
    items.sort(key=lambda item: -seconds.get(os.path.relpath(item.path, root), 0))


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported (jax, torch, transformers and every test module: over half a
    # million objects) lives to the end of the run. Out of the collector's sight, a full
    # collection (the tests' own gc.collect(), between files, and the automatic ones) takes
    # microseconds instead of 0.3 s. Nothing made later is frozen, so engines and programs a
    # file drops are still freed.
    gc.collect()
    gc.freeze()
    # Tracing makes and keeps objects by the million, which at the default thresholds (700,
    # 10, 10) set off a full collection every few seconds (about 0.3 s each, 190 of them in a
    # run); a file's own gc.collect() and the teardown's still free what it dropped.
    gc.set_threshold(10_000, 20, 20)


def pytest_configure(config: pytest.Config) -> None:
    try:
        _terminal.append(os.dup(sys.stderr.fileno()))
    except (AttributeError, ValueError, OSError):
        _terminal.append(os.dup(sys.__stderr__.fileno()))


def _end_stuck_worker(nodeid: str) -> None:
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    out = os.fdopen(os.dup(_terminal[0]), "w")
    out.write(f"\n{nodeid} is stuck past its timeout; native stacks, then Python stacks:\n")
    if spy is not None:
        command = [spy, "dump", "--native", "--pid", str(os.getpid())]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            out.write(done.stdout + done.stderr)
        except subprocess.TimeoutExpired:
            out.write("py-spy did not answer in 60 s\n")
    out.flush()
    faulthandler.dump_traceback(out, all_threads=True)
    out.flush()
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item):
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout"))
    timer = threading.Timer(limit + _HARD_EXIT_GRACE_S, _end_stuck_worker, (item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _memory_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


# A worker compiles thousands of programs over the suite, each holding about twenty memory
# mappings. At the kernel's vm.max_map_count (65530) a compile fails, and unwinding that failure
# faulted in the unwinder: the crash and, before test_fault_handlers' fix, the hang. So when a
# file is done, and its engines with it, a worker past half the limit drops its programs and
# jax's caches (between files, so no test's compile count sees it); one file adds at most about
# 20000, so the other half is headroom enough.
_MAPPINGS_LIMIT_SHARE = 1 / 2


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield  # the file's fixtures (its engines and servers) are gone after its last test
    if nextitem is not None and nextitem.path == item.path:
        return
    mappings = _memory_mappings()
    if mappings > _max_map_count() * _MAPPINGS_LIMIT_SHARE:
        program_cache.release()
        jax.clear_caches()
        gc.collect()
    # With FLIPJAX_TEST_RSS=<file>, each worker logs what it holds after each file.
    path = os.environ.get("FLIPJAX_TEST_RSS")
    if path:
        with open("/proc/self/status") as f:
            rss_mb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as f:
            f.write(
                f"{worker} {item.path.name} {rss_mb} MB {mappings} -> "
                f"{_memory_mappings()} mappings\n"
            )
