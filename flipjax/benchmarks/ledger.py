"""`python -m flipjax.bench memory`: the memory ledger of each layout of the benchmark model
under unequal device budgets, and what a flip between them holds at its peak.

The budgets are the reference deployment's (a 32 GB card and two 10 GB cards: 32:10:10),
scaled so that the 133M-parameter fp32 benchmark model (533 MB) is tight on them (`--unit`
MiB per part; default 25: 800, 250 and 250 MiB) on the first three devices of the CPU mesh.
For each layout the engine is built with those budgets and its pool sized from them
(`sharding/pool_sizing.py`); the bench prints its ledger, its KV capacity and how many
4096-token requests that holds at once, or why the layout does not fit. For each pair that
fits, a flip there and back at 1%, 25% and 100% occupancy: each device's peak, read at every
wave, against max(old, new) + the window, and the flip's time against today's (device to
device, both layouts held at once) in the same run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections import Counter

from flipjax.benchmarks.cpu_devices import ask_for_cpu_devices

ask_for_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from flipjax.benchmarks.engine import REFERENCE_CONFIG  # noqa: E402
from flipjax.benchmarks.flip import _rig, held  # noqa: E402
from flipjax.config.tree import FlipjaxConfig  # noqa: E402
from flipjax.engine.engine import Engine  # noqa: E402
from flipjax.model.config import ModelConfig  # noqa: E402
from flipjax.model.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from flipjax.model.tokenizer import ByteTokenizer  # noqa: E402
from sharding.budgets import BudgetError, format_bytes, parse_sizes  # noqa: E402
from sharding.layout import LayoutError  # noqa: E402
from sharding.ledger import DeviceMemory  # noqa: E402
from sharding.memory import live_bytes  # noqa: E402

REQUEST_TOKENS = 4096


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench memory", description=__doc__)
    p.add_argument("--parts", default="32,10,10", help="budget proportions, one per device")
    p.add_argument("--unit", type=float, default=25.0, help="MiB per part")
    p.add_argument(
        "--layouts",
        default="pp:7,3,2;pp:8,2,2;pp:6,6@1,2;tp:2",
        help="layouts to build, ';'-separated; flips are timed from the first to each other",
    )
    p.add_argument("--repeats", type=int, default=2, help="round trips timed per occupancy")
    args = p.parse_args(argv)
    budgets = ",".join(f"{int(float(x) * args.unit)}MiB" for x in args.parts.split(","))
    cfg = ModelConfig.from_hf({**REFERENCE_CONFIG, "model_type": "qwen3_next"})
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    print(f"model: 133M parameters, float32; budgets {budgets} (devices 0..)")
    held: dict[str, tuple[DeviceMemory, ...]] = {}
    pool: dict[str, int] = {}
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
        pool[layout] = engine.stats().pools["pages_total"]
        engine.close()
    fitting = {name: pages for name, pages in pool.items() if name in held}
    _flip_peaks(cfg, fitting, parse_sizes(budgets), args.repeats)


def _flip_peaks(
    cfg: ModelConfig, fitting: dict[str, int], budgets: tuple[int, ...], repeats: int
) -> None:
    """For each pair of fitting layouts: a flip there and back at 1%, 25% and 100% of the
    pool held, with each device's peak read at every wave (live arrays plus the wave program's
    temporary memory) against max(old, new) + window, and its time against today's flip
    (device to device, both layouts held at once) in the same run."""
    print(
        "\nflip peaks (windowed: measured at every wave; today's: old + new held at once) and times"
    )
    by_id = dict(enumerate(budgets))
    names = list(fitting)
    for a, b in [(names[0], b) for b in names[1:]]:
        gc.collect()
        before = {id(x) for x in jax.live_arrays()}
        layouts = _rig(cfg, min(fitting[a], fitting[b]), a)
        layouts.budgets = by_id
        layouts.arm(b)
        peak: Counter[int] = Counter()

        def measure(
            label: str, temp: Counter[int], peak: Counter[int] = peak, before: set = before
        ) -> None:
            now = live_bytes(before)
            for device in now.keys() | temp.keys():
                peak[device] = max(peak[device], now[device] + temp[device])

        for occupancy in (0.01, 0.25, 1.0):
            times: dict[str, list[float]] = {"windowed": [], "today": []}
            with held(layouts, occupancy):
                for mode in ("today", "windowed") * (repeats + 1):  # the first round warms
                    layouts.device_copy = mode == "today"
                    layouts.budgets = None if mode == "today" else by_id  # today's cannot fit
                    times[mode] += [layouts.flip(t).total_ms for t in (b, a)]
                layouts.device_copy, layouts.budgets = False, by_id
                for source, target in ((a, b), (b, a)):  # once more, read at every wave
                    old, window = live_bytes(before), layouts.window(layouts.armed[target])
                    peak.clear()
                    layouts.on_wave = measure
                    layouts.flip(target)
                    layouts.on_wave = None
                    new = live_bytes(before)
                    _print_peak(occupancy, source, target, old, new, window, peak, by_id)
            w, t = statistics.median(times["windowed"][2:]), statistics.median(times["today"][2:])
            print(
                f"  {occupancy:>4.0%} held: flip {a} <-> {b} windowed {w:.0f} ms, today's "
                f"{t:.0f} ms: windowed / today = {w / t:.2f}x (goal <= 1.5x)"
            )
        del layouts


def _print_peak(
    occupancy: float,
    source: str,
    target: str,
    old: Counter[int],
    new: Counter[int],
    window: dict[int, int],
    peak: Counter[int],
    budgets: dict[int, int],
) -> None:
    for device in sorted(old.keys() | new.keys()):
        bound = max(old[device], new[device]) + window[device]
        today = old[device] + new[device]
        print(
            f"  {occupancy:>4.0%} {source} -> {target} device {device}: old "
            f"{format_bytes(old[device])}, new {format_bytes(new[device])}, window "
            f"{format_bytes(window[device])} | peak {format_bytes(peak[device])} of bound "
            f"{format_bytes(bound)} ({'within' if peak[device] <= bound else 'OVER'}) | today's "
            f"peak {format_bytes(today)}, budget {format_bytes(budgets.get(device, 0))}"
        )
