"""Keep this process's handlers of fatal signals across loading a library that replaces them.

apache-tvm-ffi, which xgrammar loads, installs a SIGSEGV handler as its shared library loads. It
walks the stack with the C++ unwinder to print a backtrace. A fault inside the unwinder itself
(reading a JIT-compiled program's unwind tables while an exception is thrown) arrives while the
unwinder holds its lock, so that handler waits for the lock forever: the process hangs, silent,
instead of dying with a report. Python's fault handler, or the default action, reports the fault
and ends the process, so the handlers found before the load are put back after it.

It must never change a handler it did not find replaced: it restores exactly what libc reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
from collections.abc import Iterator

FATAL_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
# Larger than any libc's `struct sigaction`; only libc reads its contents.
_SIGACTION_BYTES = 512


@contextlib.contextmanager
def fatal_signal_handlers_kept() -> Iterator[None]:
    """Within the block, libraries may install handlers of fatal signals; after it, the
    process has the handlers it had before."""
    libc = ctypes.CDLL(None, use_errno=True)
    saved: dict[int, ctypes.Array[ctypes.c_char]] = {}
    for sig in FATAL_SIGNALS:
        action = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(int(sig), None, action) != 0:
            raise OSError(ctypes.get_errno(), f"sigaction could not read the {sig.name} handler")
        saved[sig] = action
    try:
        yield
    finally:
        for sig, action in saved.items():
            if libc.sigaction(int(sig), action, None) != 0:
                raise OSError(ctypes.get_errno(), f"sigaction could not restore {sig.name}")
