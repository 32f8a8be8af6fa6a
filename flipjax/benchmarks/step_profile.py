"""Where a decode step's time goes: `bench engine --profile`.

One run of the batch is traced with `jax.profiler` (the Python tracer off: it would slow the host
thread, which on a small machine shares the cores with the step). XLA:CPU's trace names each op
of a program run by its HLO name and the run it belongs to; the decode step program's optimized
HLO (`step_hlo`) says what each op is. The decode steps are the runs of the trace's most common
set of ops, which must all be the decode program's.

Per step (mean over the traced steps): each kind of op's time, the time ops ran side by side
(counted once per op above it, so taken back), the time the step program had no op running (it
waited for a thread of the pool, or for its inputs), and the time between one step program's
end and the next one's start (the sampler's program, the host's share of a step). The rows sum
to the step's time. The last line puts the step's matmuls at the bound's GEMM rate beside the
rest of the step as traced: the fraction of the matmul bound a step with that rest can reach.
"""

from __future__ import annotations

import collections
import gzip
import itertools
import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from flipjax.benchmarks.step_hlo import MATMULS, Op, module_name, ops
from flipjax.runtime.program_cache import PROGRAMS

IDLE = "no op running in the step program"
SIDE_BY_SIDE = "ops side by side (counted twice above)"
BETWEEN = "between step programs (sampling, host)"
TAIL = (IDLE, SIDE_BY_SIDE, BETWEEN)


@dataclass(frozen=True)
class StepProfile:
    steps: int  # decode steps traced
    step_s: float  # mean start-to-start of consecutive decode steps
    by_kind: dict[str, float]  # seconds per step, IDLE and BETWEEN included; sums to step_s
    matmul_flops: float  # per step

    def matmul_rate(self) -> float:
        """FLOP/s of the step's matmuls as they ran."""
        return self.matmul_flops / self.by_kind[MATMULS] if self.by_kind.get(MATMULS) else 0.0

    def best_fraction(self, gemm_flops: float) -> float:
        """The fraction of the matmul bound a step reaches with its matmuls at `gemm_flops` (the
        bound's own rate) and everything else as traced."""
        at_bound = self.matmul_flops / gemm_flops
        return at_bound / (at_bound + self.step_s - self.by_kind.get(MATMULS, 0.0))


@dataclass(frozen=True)
class Program:
    module: str  # its HLO module's name
    ops: dict[str, Op]  # its entry computation's ops by name


def decode_programs(batch: int) -> list[Program]:
    """The decode step programs of `batch` rows compiled in this process, one per distinct text
    (a binding's program key ends in stage, shape, score, verify: `Binding._key`); `profile`
    takes the one the traced steps ran."""
    texts = {
        step.as_text()
        for key, (step, _, _) in list(PROGRAMS.items())
        if key[-4:] == (0, (batch, 1), None, False)
    }
    if not texts:
        raise ValueError(f"step profile: no decode program of {batch} rows compiled")
    return [Program(module_name(text), ops(text)) for text in sorted(texts)]


def trace_events(run: Callable[[], Any]) -> list[dict]:
    """The trace events of `run()` (a perfetto trace written by `jax.profiler`, read back)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
            run()
        files = sorted(Path(folder).glob("**/perfetto_trace.json.gz"))
        if not files:
            raise RuntimeError("step profile: jax.profiler wrote no perfetto trace")
        with gzip.open(files[-1]) as f:
            doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def decode_runs(events: list[dict], programs: list[Program]) -> tuple[list[list[dict]], Program]:
    """The op events of each decode step run, in time order, and the program they ran: of the
    runs of the programs' modules (prefill steps run a module of that name too), those of the
    most common set of ops; their program is the one with the fewest ops that has them all (a
    program of another model in the process may have more, never all of these and fewer)."""
    modules = {p.module for p in programs}
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and args.get("hlo_module") in modules and "run_id" in args:
            runs[args["run_id"]].append(e)
    if not runs:
        raise ValueError(f"step profile: the trace has no op events of {', '.join(modules)}")
    sets = collections.Counter(frozenset(e["args"]["hlo_op"] for e in r) for r in runs.values())
    common, _ = sets.most_common(1)[0]
    having = [p for p in programs if common <= p.ops.keys()]
    if not having:
        unknown = sorted(
            common - min(programs, key=lambda p: len(common - p.ops.keys())).ops.keys()
        )
        raise ValueError(
            f"step profile: the most common program run has ops the decode program lacks "
            f"({', '.join(unknown[:5])}): it is not the decode step"
        )
    steps = [r for r in runs.values() if frozenset(e["args"]["hlo_op"] for e in r) == common]
    ordered = sorted((sorted(r, key=lambda e: e["ts"]) for r in steps), key=lambda r: r[0]["ts"])
    return ordered, min(having, key=lambda p: len(p.ops))


def _busy(run: list[dict]) -> float:
    """Microseconds in which at least one of the run's ops ran (ops may run side by side)."""
    busy, end = 0.0, float("-inf")
    for e in run:  # in start order
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profile(events: list[dict], programs: list[Program]) -> StepProfile:
    """The decode steps' mean breakdown from a trace's `events`, the step one of `programs`."""
    runs, program = decode_runs(events, programs)
    ops = program.ops
    if len(runs) < 2:
        raise ValueError(f"step profile: {len(runs)} decode step traced, need at least two")
    starts = [r[0]["ts"] for r in runs]
    spans = [max(e["ts"] + e["dur"] for e in r) - r[0]["ts"] for r in runs]
    step_us = statistics.fmean(b - a for a, b in itertools.pairwise(starts))
    by_kind: dict[str, float] = collections.defaultdict(float)
    for r in runs:
        for e in r:
            by_kind[ops[e["args"]["hlo_op"]].kind] += e["dur"] / len(runs)
    busy = statistics.fmean(_busy(r) for r in runs)
    by_kind[SIDE_BY_SIDE] = busy - sum(by_kind.values())
    by_kind[IDLE] = statistics.fmean(spans) - busy
    by_kind[BETWEEN] = step_us - statistics.fmean(spans)
    flops = sum(ops[e["args"]["hlo_op"]].flops for e in runs[0])
    seconds = {kind: us / 1e6 for kind, us in by_kind.items()}
    return StepProfile(len(runs), step_us / 1e6, seconds, flops)


def describe(p: StepProfile, gemm_flops: float) -> list[str]:
    """The breakdown's lines, then the best fraction of the bound a step allows."""
    lines = [f"a decode step, traced ({p.steps} steps, mean per step):"]
    order = sorted((k for k in p.by_kind if k not in TAIL), key=lambda k: -p.by_kind[k])
    for kind in [*order, *TAIL]:
        s = p.by_kind[kind]
        if kind == SIDE_BY_SIDE and abs(s) < 5e-6:
            continue  # ops ran one at a time
        line = f"  {kind:<42} {s * 1e3:7.2f} ms {s / p.step_s:6.1%}"
        if kind == MATMULS:
            line += f"  ({p.matmul_flops / 1e9:.2f} GFLOP at {p.matmul_rate() / 1e9:.0f} GFLOP/s)"
        lines.append(line)
    lines.append(f"  {'step':<42} {p.step_s * 1e3:7.2f} ms")
    at_bound = p.matmul_flops / gemm_flops
    rest = p.step_s - p.by_kind.get(MATMULS, 0.0)
    lines.append(
        f"  its matmuls at the bound's GEMM rate ({gemm_flops / 1e9:.0f} GFLOP/s, timed after "
        f"the trace) would take {at_bound * 1e3:.2f} ms; with the rest of the step as traced "
        f"({rest * 1e3:.2f} ms), a step reaches at most {p.best_fraction(gemm_flops):.0%} of "
        f"the matmul bound"
    )
    return lines
