"""`bench engine --profile`: each op of a decode step named by its kind from the program's HLO,
a product's FLOPs from its shapes, and a traced step's time split so that its rows sum to the
step. The oracles: the shapes the test multiplies, transformers' own `nn.Linear` weights (every
one a product of a decode step), and a hand-built trace whose sums are worked out below."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

from flipjax import Engine, SamplingParams
from flipjax.benchmarks import step_hlo, step_profile
from flipjax.benchmarks.step_hlo import MATMULS, OTHER_XLA, Op
from flipjax.benchmarks.step_profile import BETWEEN, IDLE, SIDE_BY_SIDE, Program
from kernels_pallas.matmul import native_binding as matmul_native
from kernels_pallas.pointwise import native_binding as gates_native
from tests.support.hf_oracle import make_checkpoint


def test_each_op_is_named_by_its_kind_and_each_products_flops_by_its_shapes():
    one = matmul_native.targets()
    several = matmul_native.targets(handlers=matmul_native.SEVERAL)

    def step(x, w1, w2, w3, v):
        a = matmul_native.matmul(one, x, w1)  # [8, 64] x [64, 96]
        b, c = matmul_native.matmuls(several, x, [w2, w3])  # [64, 40] and [64, 24] in one call
        d = jnp.tanh(a) @ v  # XLA's dot: [8, 96] x [96, 32]
        return gates_native.gate("silu", b, b), c, d

    shapes = [(8, 64), (64, 96), (64, 40), (64, 24), (96, 32)]
    hlo = jax.jit(step).lower(*(jnp.zeros(s) for s in shapes)).compile().as_text()
    found = step_hlo.ops(hlo)
    products = sorted(op.flops for op in found.values() if op.kind == MATMULS)
    assert products == sorted([2 * 8 * 64 * 96, 2 * 8 * 64 * (40 + 24), 2 * 8 * 96 * 32])
    assert [op.kind for op in found.values()].count("gates") == 1
    assert all(op.flops == 0 for op in found.values() if op.kind != MATMULS)
    assert step_hlo.module_name(hlo) == "jit_step"


def _run(module: str, run_id: str, start: float, ops: list[tuple[str, float, float]]) -> list:
    return [
        {
            "ph": "X",
            "name": name,
            "ts": start + at,
            "dur": dur,
            "args": {"hlo_module": module, "hlo_op": name, "run_id": run_id},
        }
        for name, at, dur in ops
    ]


PROGRAM = Program(
    "jit_step",
    {"mm": Op(MATMULS, 2e9), "norm": Op(OTHER_XLA, 0.0), "gdn": Op("GDN recurrence", 0.0)},
)
# A decode step every 10 ms: the product for 6, nothing for 0.5, then the norm (1 ms) and the
# recurrence (1.5 ms) overlapping by 0.5: busy 8 of a span of 8.5, 8.5 counted by op.
STEP = [("mm", 0, 6000), ("norm", 6500, 1000), ("gdn", 7000, 1500)]
WANT = {
    MATMULS: 0.006,
    OTHER_XLA: 0.001,
    "GDN recurrence": 0.0015,
    SIDE_BY_SIDE: -0.0005,
    IDLE: 0.0005,
    BETWEEN: 0.0015,  # from a span's end (8.5 ms) to the next step's start
}


def test_a_traced_steps_rows_sum_to_the_step_and_bound_what_a_step_can_reach():
    # As many prefill runs as steps, of the same module and ops named alike (the step's but
    # one), before the steps; a write program and the sampler after each step.
    events = []
    for i in range(3):
        events += _run("jit_step", f"p{i}", -9000 + i * 3000, [("mm", 0, 2000), ("norm", 0, 9)])
    for i in range(3):
        events += _run("jit_step", f"d{i}", i * 10_000, STEP)
        events += _run("jit_step", f"w{i}", i * 10_000 + 8550, [("write", 0, 30)])
        events += _run("jit_sample", f"s{i}", i * 10_000 + 8600, [("mm", 0, 300)])
    # Programs of other models in the process: one with these ops and more, one without the
    # norm. The steps ran the one whose ops they ran, all of them and no other.
    bigger = Program("jit_step", {**PROGRAM.ops, "mm": Op(MATMULS, 7e9), "mm2": Op(MATMULS, 1)})
    lacking = Program("jit_step", {k: v for k, v in PROGRAM.ops.items() if k != "norm"})
    p = step_profile.profile(events, [bigger, lacking, PROGRAM])
    assert p.steps == 3
    assert p.step_s == pytest.approx(0.010)
    assert p.by_kind == pytest.approx(WANT)
    assert p.matmul_rate() == pytest.approx(2e9 / 0.006)
    # At 1 TFLOP/s the product takes 2 ms; the rest of the step 4: at most a third of the bound.
    assert p.best_fraction(1e12) == pytest.approx(2 / 6)
    lines = step_profile.describe(p, 1e12)
    assert any(line.split()[0] == "matmuls" and "6.00 ms" in line for line in lines)
    assert "at most 33% of the matmul bound" in lines[-1]
    assert "bound" not in " ".join(step_profile.describe(p, None))  # quantized: no bound


def test_a_step_missing_from_the_trace_is_not_counted_as_a_long_step():
    """A run between two steps with most of a step's ops (another step program, or a step
    traced in part) breaks the pair: the time across it is no step's."""
    events = []
    for i in (0, 1, 3, 4):
        events += _run("jit_step", f"d{i}", i * 10_000, STEP)
    events += _run("jit_step", "partial", 20_000, STEP[:2])
    p = step_profile.profile(events, [PROGRAM])
    assert p.steps == 4
    assert p.step_s == pytest.approx(0.010)
    assert p.by_kind == pytest.approx(WANT)


def test_a_trace_without_the_decode_programs_runs_is_refused():
    events = []
    for i in range(3):
        events += _run("jit_step", f"d{i}", i * 10_000, [*STEP, ("scatter", 8600, 10)])
    with pytest.raises(ValueError, match="0 traced run has exactly the ops of a decode program"):
        step_profile.profile(events, [PROGRAM])
    with pytest.raises(ValueError, match="no op events of jit_other"):
        step_profile.profile(events, [Program("jit_other", PROGRAM.ops)])
    twins = [PROGRAM, Program("jit_step", dict(PROGRAM.ops, mm=Op(MATMULS, 1.0)))]
    with pytest.raises(ValueError, match="same ops"):
        step_profile.profile(
            _run("jit_step", "a", 0, STEP) + _run("jit_step", "b", 9e3, STEP), twins
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_real_decode_step_is_traced_with_every_weight_of_the_model_multiplied(tmp_path, dtype):
    hf = make_checkpoint(str(tmp_path))
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    engine = Engine.from_pretrained(
        str(tmp_path), dtype=dtype, num_pages=32, max_running_requests=2
    )
    engine.warmup()
    prompts = [[(7 * i + 3) % 128 for i in range(n)] for n in (9, 14)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    events = step_profile.trace_events(lambda: engine.generate(prompts, sampling=params))
    p = step_profile.profile(events, step_profile.decode_programs(2))
    assert p.steps >= 6  # 7 decode steps and the overlap's one more, the first two can differ
    assert p.matmul_flops == 2 * 2 * linear
    kinds = {k for k, s in p.by_kind.items() if s > 0}
    assert {MATMULS, "GDN recurrence", "decode attention"} <= kinds
    assert p.by_kind[IDLE] >= 0 and p.by_kind[BETWEEN] >= 0 and p.by_kind[SIDE_BY_SIDE] <= 1e-9
    assert p.step_s > p.by_kind[MATMULS] > 0
