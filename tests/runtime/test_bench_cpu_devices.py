"""The layout benchmarks spread over eight virtual CPU devices even though importing flipjax
has already put a flag of its own into `XLA_FLAGS`; a count the caller names is kept."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = "import flipjax.benchmarks.flip, jax; print(jax.device_count())"


def _devices(xla_flags: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_the_flip_bench_gets_eight_cpu_devices_beside_flipjaxs_own_flag():
    assert _devices(None) == 8


def test_a_device_count_the_caller_names_is_kept():
    assert _devices("--xla_force_host_platform_device_count=3") == 3
