"""The matmul bound of `bench engine`, timed beside each of flipjax's runs.

A decode step's GEMM FLOPs at the rate of an [batch, 768] x [768, 32000] GEMM whose weight is
read from memory (`machine.gemm_flops`), by XLA's dot and by the native matmul where it builds
(the engine's `Linear` runs whichever this machine's calibration picked, so the bound takes the
faster). The GEMM is timed right after each of flipjax's runs, so that a round's decode rate is
put against the rate of its own spell of the machine: timed once after all the rounds, the
bound of one spell divided the best decode of another, and one build read 60% of its bound at
batch 8 in one run and 90% in the next (a 2-core Zen 3 whose FMA peak drifted by a third).
Paired so, one run's rounds at batch 8 still read 72%, 118% and 48% on that machine: the
headline is their median, and every round is printed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp

from flipjax.benchmarks.machine import gemm_flops
from flipjax.benchmarks.run_timing import Timing
from kernels_pallas import native


@dataclass(frozen=True)
class Round:
    """One of flipjax's runs: its decode rate and the GEMM rates timed right after it."""

    decode_tok_s: float
    gemm_flops: dict[str, float]  # FLOP/s by kernel: "XLA", and "native" where it builds

    def bound_tok_s(self, batch: int, step_flops: float) -> float:
        """Decode tokens per second if the step's FLOPs ran at the faster GEMM's rate."""
        return batch * max(self.gemm_flops.values()) / step_flops


def gemm_rates(batch: int, dtype: jnp.dtype) -> dict[str, float]:
    """FLOP/s of the bound's GEMM at `batch` rows, by each kernel this machine has."""
    rates = {"XLA": gemm_flops(batch, dtype=dtype)}
    if native.available():
        rates["native"] = gemm_flops(batch, dtype=dtype, kernel="native")
    return rates


def timed_beside(
    run: Callable[[], Timing], batch: int, dtype: jnp.dtype, rounds: list[Round]
) -> Callable[[], Timing]:
    """`run`, with the bound's GEMM timed right after each call, noted in `rounds`."""

    def run_then_gemm() -> Timing:
        timing = run()
        rounds.append(Round(timing.decode_tok_s, gemm_rates(batch, dtype)))
        return timing

    return run_then_gemm


def describe(rounds: list[Round], batch: int, step_flops: float) -> str:
    """flipjax's decode against the bound: the median of its rounds' fractions (each round's
    against its own GEMM; a spell that slows one of the pair and not the other skews a round
    either way, so neither the best nor the fastest round's fraction is the headline), then
    every round's, and the fastest round's rates."""
    if not rounds:
        raise ValueError("matmul bound: no round of flipjax was timed")
    fractions = [r.decode_tok_s / r.bound_tok_s(batch, step_flops) for r in rounds]
    r = max(rounds, key=lambda r: r.decode_tok_s)
    rates = ", ".join(f"{name} {rate / 1e9:.0f} GFLOP/s" for name, rate in r.gemm_flops.items())
    return (
        f"flipjax decode reaches {statistics.median(fractions):.0%} of the matmul bound (the "
        f"median of its rounds, each against the GEMM timed right after it: "
        + ", ".join(f"{f:.0%}" for f in fractions)
        + f"); its fastest round {r.decode_tok_s:.0f} against "
        f"{r.bound_tok_s(batch, step_flops):.0f} tok/s ({rates})"
    )
