"""`python -m flipjax.bench memory`: the memory ledger of each layout of the benchmark model
under unequal device budgets, and what a flip between them holds at its peak.

The budgets are the reference deployment's (a 32 GB card and two 10 GB cards: 32:10:10),
scaled so that the 133M-parameter fp32 benchmark model (533 MB) is tight on them (`--unit`
MiB per part; default 25: 800, 250 and 250 MiB) on the first three devices of the CPU mesh.
For each layout the engine is built with those budgets and its pool sized from them
(`sharding/pool_sizing.py`); the bench prints its ledger, its KV capacity and how many
4096-token requests that holds at once, or why the layout does not fit. For each pair that
fits, the peak a flip holds per device today (the old layout's arrays and the new one's at
once) is set against max(old, new) + a 5% window.
"""

from __future__ import annotations

import argparse
import os

if "XLA_FLAGS" not in os.environ:  # on the CPU, give the layouts eight devices to use
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from flipjax.benchmarks.engine import REFERENCE_CONFIG  # noqa: E402
from flipjax.config.tree import FlipjaxConfig  # noqa: E402
from flipjax.engine.engine import Engine  # noqa: E402
from flipjax.model.config import ModelConfig  # noqa: E402
from flipjax.model.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from flipjax.model.tokenizer import ByteTokenizer  # noqa: E402
from sharding.budgets import BudgetError, format_bytes, parse_sizes  # noqa: E402
from sharding.layout import LayoutError  # noqa: E402
from sharding.ledger import DeviceMemory  # noqa: E402

REQUEST_TOKENS = 4096
WINDOW_FRACTION = 0.05


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench memory", description=__doc__)
    p.add_argument("--parts", default="32,10,10", help="budget proportions, one per device")
    p.add_argument("--unit", type=float, default=25.0, help="MiB per part")
    p.add_argument(
        "--layouts", default="pp:7,3,2;pp:8,2,2;tp:2", help="layouts to build, ';'-separated"
    )
    args = p.parse_args(argv)
    budgets = ",".join(f"{int(float(x) * args.unit)}MiB" for x in args.parts.split(","))
    cfg = ModelConfig.from_hf({**REFERENCE_CONFIG, "model_type": "qwen3_next"})
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    print(f"model: 133M parameters, float32; budgets {budgets} (devices 0..)")
    held: dict[str, tuple[DeviceMemory, ...]] = {}
    for layout in args.layouts.split(";"):
        config = FlipjaxConfig.build(
            layout=layout, device_memory=budgets, max_running_requests=8, max_prefill_tokens=256
        )
        try:
            engine = Engine(model, ByteTokenizer(), config)
        except (BudgetError, LayoutError) as e:
            print(f"\n{layout}: does not fit: {e}")
            continue
        engine.warmup()
        report = engine.memory()
        print("\n" + report.table())
        pages = report.capacity[0].pages or 0
        print(
            f"{layout}: pool {engine.stats().pools['pages_total']} pages; holds "
            f"{pages * 16 // REQUEST_TOKENS} requests of {REQUEST_TOKENS} tokens at once"
        )
        held[layout] = report.devices
        engine.close()
    _flip_peaks(held, parse_sizes(budgets))


def _flip_peaks(held: dict[str, tuple[DeviceMemory, ...]], budgets: tuple[int, ...]) -> None:
    """Per device, a flip's peak today (both layouts' arrays at once) against the goal."""
    print("\nflip peak per device (today: old + new held at once; goal: max(old, new) + window)")
    names = list(held)
    for a in names:
        for b in names:
            if a == b:
                continue
            old = {d.device: d.used - d.bytes["reserve"] for d in held[a]}
            new = {d.device: d.used - d.bytes["reserve"] for d in held[b]}
            for device in sorted(old.keys() | new.keys()):
                o, n = old.get(device, 0), new.get(device, 0)
                budget = budgets[device] if device < len(budgets) else 0
                goal = max(o, n) + WINDOW_FRACTION * budget
                print(
                    f"  {a} -> {b} device {device}: old {format_bytes(o)}, new "
                    f"{format_bytes(n)}, peak today {format_bytes(o + n)}, goal "
                    f"{format_bytes(goal)}, budget {format_bytes(budget)}"
                    + ("  (over budget)" if o + n > budget else "")
                )
