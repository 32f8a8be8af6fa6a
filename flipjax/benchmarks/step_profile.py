"""Where a decode step's time goes: `bench engine --profile`.

One run of the batch is traced with `jax.profiler` (the Python tracer off: it would slow the host
thread, which on a small machine shares the cores with the step). XLA:CPU's trace names each op
of a program run by its HLO name and the run it belongs to; the decode step program's optimized
HLO (`step_hlo`) says what each op is. The decode steps are the runs with exactly the decode
program's ops.

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
import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from flipjax.benchmarks.matmul_bound import gemm_rates
from flipjax.benchmarks.step_hlo import MATMULS, Op, module_name, ops
from flipjax.runtime.buckets import pow2_bucket
from flipjax.runtime.program_cache import PROGRAMS

IDLE = "no op running in the step program"
SIDE_BY_SIDE = "ops side by side (counted more than once above)"
BETWEEN = "between step programs (sampling, host)"
TAIL = (IDLE, SIDE_BY_SIDE, BETWEEN)


@dataclass(frozen=True)
class StepProfile:
    steps: int  # decode steps traced
    step_s: float  # mean span of a step program, and from its end to the next step's start
    by_kind: dict[str, float]  # seconds per step, IDLE and BETWEEN included; sums to step_s
    matmul_flops: float  # per step

    def matmul_rate(self) -> float:
        """FLOP/s of the step's matmuls as they ran."""
        return self.matmul_flops / self.by_kind[MATMULS] if self.by_kind.get(MATMULS) else 0.0

    @property
    def rest_s(self) -> float:
        """Seconds of a step outside its matmuls."""
        return self.step_s - self.by_kind.get(MATMULS, 0.0)

    def best_fraction(self, gemm_flops: float) -> float:
        """The fraction of the matmul bound a step reaches with its matmuls at `gemm_flops` (the
        bound's own rate) and everything else as traced."""
        at_bound = self.matmul_flops / gemm_flops
        return at_bound / (at_bound + self.rest_s)


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


def decode_runs(
    events: list[dict], programs: list[Program]
) -> tuple[list[list[dict]], list[bool], Program]:
    """Each run of the programs' modules, in time order (each run's events in time order),
    whether it is a decode step, and which of `programs` the steps ran: the one whose every op,
    and no other, ran in the most runs (prefill steps and a step's write program run modules of
    the same name, and their ops are named alike, but never all of the step's)."""
    modules = {p.module for p in programs}
    by_id: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "dur" in e and args.get("hlo_module") in modules:
            by_id[args.get("run_id", "")].append(e)
    if not by_id:
        raise ValueError(f"step profile: the trace has no op events of {', '.join(modules)}")
    runs = sorted(
        (sorted(r, key=lambda e: e["ts"]) for r in by_id.values()), key=lambda r: r[0]["ts"]
    )
    sets = [frozenset(e["args"]["hlo_op"] for e in r) for r in runs]
    counts = [sum(s == p.ops.keys() for s in sets) for p in programs]
    best = max(counts)
    if best < 2:
        raise ValueError(
            f"step profile: {best} traced run has exactly the ops of a decode program of "
            f"{len(programs[0].ops)} ops (runs of {sorted({len(s) for s in sets})} ops)"
        )
    if counts.count(best) > 1:
        raise ValueError("step profile: two decode programs have the same ops; cannot tell them")
    program = programs[counts.index(best)]
    return runs, [s == program.ops.keys() for s in sets], program


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
    """The decode steps' mean breakdown from a trace's `events`, the step one of `programs`.
    A step's time is its program's span and the time from its end to the next step's start,
    the latter over pairs of steps with no other step program (a prefill) between them."""
    runs, step, program = decode_runs(events, programs)
    ops = program.ops
    steps = [i for i, is_step in enumerate(step) if is_step]
    ends = [max(e["ts"] + e["dur"] for e in r) for r in runs]
    gaps, last = [], None  # the index of the last step seen, while no other step came since
    for i, r in enumerate(runs):
        if step[i]:
            if last is not None:
                gaps.append(r[0]["ts"] - ends[last])
            last = i
        elif len(r) * 2 >= len(ops):  # another step program: the pair spans it
            last = None
    if not gaps:
        raise ValueError("step profile: no two decode steps ran one after the other")
    span = statistics.fmean(ends[i] - runs[i][0]["ts"] for i in steps)
    by_kind: dict[str, float] = collections.defaultdict(float)
    for i in steps:
        for e in runs[i]:
            by_kind[ops[e["args"]["hlo_op"]].kind] += e["dur"] / len(steps)
    busy = statistics.fmean(_busy(runs[i]) for i in steps)
    by_kind[SIDE_BY_SIDE] = busy - sum(by_kind.values())
    by_kind[IDLE] = span - busy
    by_kind[BETWEEN] = statistics.fmean(gaps)
    flops = sum(op.flops for op in ops.values())
    seconds = {kind: us / 1e6 for kind, us in by_kind.items()}
    return StepProfile(len(steps), (span + by_kind[BETWEEN]) / 1e6, seconds, flops)


def report(run: Callable[[], Any], batch: int, dtype: jnp.dtype | None) -> list[str]:
    """`run()` (a batch of `batch` rows) traced, and its decode steps' breakdown described;
    with `dtype`, against the bound's GEMM timed right after, the fastest of three timings: in a
    slow spell of the GEMM alone (54 against 97 GFLOP/s minutes apart, one 2-core machine) the
    cap read 91% where the runs around it read 84-86%."""
    events = trace_events(run)
    traced = profile(events, decode_programs(pow2_bucket(batch)))  # the rows a step runs
    if dtype is None:
        return describe(traced, None)
    return describe(traced, max(max(gemm_rates(batch, dtype).values()) for _ in range(3)))


def describe(p: StepProfile, gemm_flops: float | None) -> list[str]:
    """The breakdown's lines, then (given the bound's GEMM rate) the best fraction of the bound
    a step allows."""
    lines = [f"a decode step, traced ({p.steps} steps, mean per step):"]
    order = sorted((k for k in p.by_kind if k not in TAIL), key=lambda k: -p.by_kind[k])
    for kind in [*order, *TAIL]:
        s = p.by_kind[kind]
        if kind == SIDE_BY_SIDE and abs(s) < 5e-6:
            continue  # ops ran one at a time
        line = f"  {kind:<48} {s * 1e3:7.2f} ms {s / p.step_s:6.1%}"
        if kind == MATMULS:
            line += f"  ({p.matmul_flops / 1e9:.2f} GFLOP at {p.matmul_rate() / 1e9:.0f} GFLOP/s)"
        lines.append(line)
    lines.append(f"  {'step':<48} {p.step_s * 1e3:7.2f} ms")
    if gemm_flops is None:
        return lines
    lines.append(
        f"  its matmuls at the bound's GEMM rate ({gemm_flops / 1e9:.0f} GFLOP/s, the fastest of "
        f"three timed after the trace) would take {p.matmul_flops / gemm_flops * 1e3:.2f} ms; "
        f"with the rest of the step as traced ({p.rest_s * 1e3:.2f} ms), a step reaches at most "
        f"{p.best_fraction(gemm_flops):.0%} of the matmul bound"
    )
    return lines
