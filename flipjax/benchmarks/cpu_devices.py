"""The virtual CPU devices a layout benchmark spreads over: XLA reads its flags when its first
backend starts, so a benchmark asks for them before it touches jax."""

from __future__ import annotations

import os

COUNT_FLAG = "--xla_force_host_platform_device_count"


def ask_for_cpu_devices(count: int = 8) -> None:
    """On the CPU, give the layouts `count` devices to use, unless `XLA_FLAGS` names a count
    already (other flags there, such as the one importing flipjax sets, are kept)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {COUNT_FLAG}={count}".strip()
