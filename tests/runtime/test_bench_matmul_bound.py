"""`bench engine`'s matmul bound is timed right after each of flipjax's runs, and each round's
decode is put against the GEMM rate of its own spell, never against another round's."""

from __future__ import annotations

import pytest

from flipjax.benchmarks import matmul_bound
from flipjax.benchmarks.matmul_bound import Round, describe, timed_beside
from flipjax.benchmarks.run_timing import Timing


def test_the_gemm_is_timed_after_every_run_of_the_system(monkeypatch):
    events: list[str] = []
    rates = iter([{"XLA": 1e9}, {"XLA": 2e9, "native": 3e9}])

    def gemm_rates(batch, dtype):
        events.append(f"gemm {batch}")
        return next(rates)

    monkeypatch.setattr(matmul_bound, "gemm_rates", gemm_rates)
    decodes = iter([40.0, 55.0])

    def run() -> Timing:
        events.append("run")
        return Timing(100.0, next(decodes), 1.0)

    rounds: list[Round] = []
    paired = timed_beside(run, 8, "float32", rounds)
    assert [paired().decode_tok_s for _ in range(2)] == [40.0, 55.0]
    assert events == ["run", "gemm 8", "run", "gemm 8"]
    assert rounds == [Round(40.0, {"XLA": 1e9}), Round(55.0, {"XLA": 2e9, "native": 3e9})]


def test_each_round_is_put_against_its_own_gemm_at_the_faster_kernel():
    # 8 rows, 1.6e9 FLOPs a step: at 1e9 FLOP/s a step takes 1.6 s, 5 tok/s; at 4e9, 20 tok/s.
    rounds = [
        Round(decode_tok_s=4.0, gemm_flops={"XLA": 1e9}),  # 80% of 5 tok/s
        Round(decode_tok_s=18.0, gemm_flops={"XLA": 2e9, "native": 4e9}),  # 90% of 20
        Round(decode_tok_s=3.5, gemm_flops={"XLA": 0.5e9}),  # 140% of 2.5: a slow GEMM spell
    ]
    line = describe(rounds, batch=8, step_flops=1.6e9)
    assert line.startswith("flipjax decode reaches 90% of the matmul bound (the median")
    assert "timed right after it: 80%, 90%, 140%)" in line
    assert line.endswith("fastest round 18 against 20 tok/s (XLA 2 GFLOP/s, native 4 GFLOP/s)")
    with pytest.raises(ValueError, match="no round of flipjax"):
        describe([], 8, 1.6e9)
