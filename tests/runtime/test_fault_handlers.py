"""A fault in the C++ unwinder ends the process with a report; it never hangs it.

The suite once hung for good: a worker at its memory-mapping limit failed a compile, unwinding
the C++ exception faulted inside the unwinder, and the SIGSEGV handler that xgrammar's
apache-tvm-ffi installs then waited forever for the unwinder's lock. The program below builds
that fault on purpose (unwind tables registered, then unmapped) and throws through XLA.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

_PROGRAM = """
import ctypes, faulthandler
faulthandler.enable()
import flipjax.runtime.grammar
flipjax.runtime.grammar.xgrammar()  # loads xgrammar, and with it apache-tvm-ffi
import jax, jax.numpy as jnp

libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
page = libc.mmap(None, 4096, 3, 0x22, -1, 0)  # read/write, private and anonymous
ctypes.c_uint32.from_address(page).value = 16  # a table that is not empty
ctypes.CDLL("libgcc_s.so.1").__register_frame(ctypes.c_void_p(page))
libc.munmap(ctypes.c_void_p(page), 4096)  # freed, still registered
print("registered", flush=True)
jax.jit(jax.ffi.ffi_call("no_such_target", jax.ShapeDtypeStruct((), jnp.float32)))()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="registers unwind tables with libgcc_s")
def test_a_fault_while_unwinding_ends_the_process_with_a_report():
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process hung after the fault:\n{e.stderr}")
    assert "registered" in done.stdout, done.stderr
    assert done.returncode == -signal.SIGSEGV, done.stderr
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "Segfault encountered" not in done.stderr  # apache-tvm-ffi's handler never ran
