"""Per-step host buffers reuse freed memory instead of faulting fresh pages in."""

import subprocess
import sys
import textwrap

# A fresh process, since the malloc settings are process-wide and other tests' engines set them.
_PROGRAM = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from flipjax.runtime import host_memory

    if sys.argv[1] == "keep":
        assert host_memory.keep_freed_buffers()

    def step():  # a step's temporaries: four 6 MB buffers, written, then freed
        for b in [np.empty(6 << 20, np.uint8) for _ in range(4)]:
            b[::4096] = 1

    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
    """
)


def _faults_per_call(mode: str) -> float:
    run = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert run.returncode == 0, run.stderr
    return float(run.stdout.split()[-1])


def test_step_sized_buffers_are_reused_not_faulted_in():
    pages = 4 * (6 << 20) // 4096  # touched per step
    plain = _faults_per_call("plain")
    kept = _faults_per_call("keep")
    # With glibc's defaults the freed heap top is trimmed and faulted back in: the premise.
    assert plain > pages / 4, plain
    assert kept < pages / 100, (kept, plain)
