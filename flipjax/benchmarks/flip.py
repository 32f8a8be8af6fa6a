"""`python -m flipjax.bench flip`: a live phase flip against a plain copy and against a restart.

On the engine benchmark's reference model (133M parameters, fp32, random weights) with a KV pool
and GDN slots, the engine starts in layout A with B armed, then flips A -> B -> A repeatedly
with 1%, 25% and 100% of the pages and slots held: a flip moves the live set, so its cost grows
with occupancy, not with the pool. Peers, in the same run: `jax.device_put` of the same trees
between the same placements (what a flip of a full pool cannot beat), and a restart into B in a
fresh process (restore from an orbax checkpoint plus the warm-up compile of every step shape),
which is what a server without flips would do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from flipjax.benchmarks.cpu_devices import ask_for_cpu_devices

ask_for_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from flipjax.benchmarks.engine import REFERENCE_CONFIG  # noqa: E402
from flipjax.config.engine import EngineConfig  # noqa: E402
from flipjax.engine.engine import Engine  # noqa: E402
from flipjax.model.config import ModelConfig  # noqa: E402
from flipjax.model.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from flipjax.runtime.allocator import Allocator  # noqa: E402
from flipjax.runtime.model_runner import ModelRunner  # noqa: E402
from flipjax.runtime.runner_shape import RunnerShape  # noqa: E402
from sharding.flip import FlipRecord, Layouts  # noqa: E402
from sharding.layout import placement_for  # noqa: E402

ENGINE_OPTIONS = dict(num_pages=2048, max_running_requests=8, max_prefill_tokens=64)


def _median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass
class _Holder:
    """Holds pages and slots the way a request does, to set the pool's occupancy."""

    request_id: str
    pages: list[int] = field(default_factory=list)
    slot: int | None = None


def _rig(cfg: ModelConfig, num_pages: int, layout: str) -> Layouts:
    """The state an engine with `ENGINE_OPTIONS` holds, placed in `layout`, and its layouts:
    the pools are held directly here (an engine's requests would hold them), so the flip is
    used as a library."""
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    ec = EngineConfig(**{**ENGINE_OPTIONS, "num_pages": num_pages})
    shape = RunnerShape(
        cfg,
        jnp.float32,
        ec.page_size,
        ec.num_pages,
        ec.slots,
        ec.model_len(cfg),
        ec.max_running_requests,
        ec.max_prefill_tokens,
    )
    runner = ModelRunner(graphdef, params, shape, placement_for(layout, cfg))
    return Layouts(runner, Allocator(ec.num_pages, ec.slots, ec.page_size), state_io=True)


@contextmanager
def held(layouts: Layouts, occupancy: float) -> Iterator[None]:
    """`occupancy` of the pool's pages and slots held, as requests would hold them."""
    allocator = layouts.allocator
    holders = [_Holder(f"bench-{i}") for i in range(max(1, int(occupancy * allocator.slots.total)))]
    pages = max(1, int(occupancy * allocator.pages.total))
    for i, h in enumerate(holders):
        allocator.take_slot(h)
        share = pages // len(holders) + (i < pages % len(holders))
        allocator.grow(h, share * allocator.page_size)
    try:
        yield
    finally:
        for h in holders:
            allocator.free(h)


def _flips_at(
    layouts: Layouts, occupancy: float, a: str, b: str, repeats: int
) -> dict[str, list[FlipRecord]]:
    """Flip a -> b -> a `repeats` times with `occupancy` of the pages and slots held."""
    records: dict[str, list[FlipRecord]] = {a: [], b: []}
    with held(layouts, occupancy):
        for _ in range(repeats):
            for target in (b, a):
                records[target].append(layouts.flip(target))
    return records


def _restart_child(folder: str, layout: str) -> None:
    """Runs in a fresh process: restore into `layout` and compile, print seconds."""
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(folder, layout=layout, **ENGINE_OPTIONS)
    restored = time.perf_counter() - t0
    engine.warmup()
    print(f"{restored:.3f} {time.perf_counter() - t0:.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench flip", description=__doc__)
    p.add_argument("--a", default="pp:8,4", help="starting layout")
    p.add_argument("--b", default="tp:2", help="layout flipped to")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-pages", type=int, default=ENGINE_OPTIONS["num_pages"])
    p.add_argument("--restart-child", nargs=2, metavar=("FOLDER", "LAYOUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restart_child:
        _restart_child(*args.restart_child)
        return

    from flipjax.model import orbax_io as orbax_ckpt
    from sharding.flip_copy import shardings_of  # the same target trees the flip moves

    cfg = ModelConfig.from_hf({**REFERENCE_CONFIG, "model_type": "qwen3_next"})
    layouts = _rig(cfg, args.num_pages, args.a)
    runner = layouts.runner
    runner.warmup()
    runner.warm_state_io()
    t0 = time.perf_counter()
    layouts.arm(args.b)
    print(
        f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; arm {args.b}: "
        f"{time.perf_counter() - t0:.1f} s"
    )

    full: dict[str, list] = {}
    print(
        f"{'occupancy':>9} {'pages':>6} {'direction':>16} {'flip ms':>8} {'pools ms':>9} "
        f"{'pools MiB moved':>16} {'of':>6}"
    )
    for occupancy in (0.01, 0.25, 1.0):
        records = _flips_at(layouts, occupancy, args.a, args.b, args.repeats)
        for target, source in ((args.b, args.a), (args.a, args.b)):
            recs = records[target]
            r = recs[-1]
            pools_ms = statistics.median(x.kv_ms + x.gdn_ms for x in recs)
            pools = (r.kv_bytes + r.gdn_bytes) / 2**20
            held = (r.held_bytes - r.weights_bytes) / 2**20
            print(
                f"{occupancy:>9.0%} {r.live_pages:>6} {source + '->' + target:>16} "
                f"{statistics.median(x.total_ms for x in recs):>8.1f} {pools_ms:>9.1f} "
                f"{pools:>16.1f} {held:>6.1f}"
            )
        full = records
    tree = (runner.binding.params, runner.binding.state)
    placements = {name: layouts.armed[name] for name in (args.a, args.b)}
    shardings = {name: shardings_of(runner, pl) for name, pl in placements.items()}
    copies = {}
    for source, target in ((args.a, args.b), (args.b, args.a)):
        here = jax.block_until_ready(jax.device_put(tree, shardings[source]))
        copies[target] = _median_ms(
            lambda t=target, h=here: jax.block_until_ready(jax.device_put(h, shardings[t])),
            args.repeats,
        )
        del here
    for target, source in ((args.b, args.a), (args.a, args.b)):
        recs = full[target]
        flip_ms = statistics.median(r.total_ms for r in recs)
        r = recs[-1]
        print(
            f"flip {source} -> {target} at 100%: {flip_ms:7.1f} ms for "
            f"{r.total_bytes / 2**20:.0f} MiB (weights {r.weights_ms:.1f} ms, KV {r.kv_ms:.1f} "
            f"ms, GDN {r.gdn_ms:.1f} ms) | device_put of the same trees {copies[target]:7.1f} ms "
            f"| flip / copy = {flip_ms / copies[target]:.2f}x (target <= 1.5x)"
        )
    records = full

    with tempfile.TemporaryDirectory() as folder:
        ckpt = os.path.join(folder, "orbax")
        orbax_ckpt.save(ckpt, runner.params, cfg, jnp.float32, copy_from=None)
        child = subprocess.run(
            [sys.executable, "-m", "flipjax.bench", "flip", "--restart-child", ckpt, args.b],
            capture_output=True,
            text=True,
            check=True,
        )
    restored_s, restart_s = map(float, child.stdout.split()[-2:])
    flip_s = statistics.median(r.total_ms for r in records[args.b]) / 1e3
    print(
        f"restart into {args.b}: {restart_s:.2f} s (orbax restore {restored_s:.2f} s, then "
        f"warm-up compile) | flip {flip_s * 1e3:.1f} ms | restart / flip = "
        f"{restart_s / flip_s:.0f}x (target >= 10x)"
    )
