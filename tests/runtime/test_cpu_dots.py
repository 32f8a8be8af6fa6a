"""On the CPU, fp32 step programs of 8 to 16 rows compile their matmuls for Eigen, the rest for
YNNPACK (see `flipjax.runtime.cpu_dots`); the choice shows in the compiled program."""

from __future__ import annotations

from flipjax import Engine
from tests.support.internals import parts

_YNN = '"kind":"__ynn_fusion"'


def _step_text(engine: Engine, shape: tuple[int, int]) -> str:
    step, _ = parts(engine).runner.binding.programs(0, shape)
    return step.as_text()


def test_fp32_steps_of_8_to_16_rows_use_eigen_dots_and_the_rest_ynnpack():
    engine = Engine.from_pretrained("tiny", max_running_requests=32)
    assert _YNN not in _step_text(engine, (8, 1)), "an 8-row step kept YNNPACK dots"
    assert _YNN in _step_text(engine, (32, 1)), "a 32-row step lost YNNPACK dots"
    sharded = Engine.from_pretrained("tiny", layout="tp:2", max_running_requests=16)
    assert _YNN not in _step_text(sharded, (16, 1)), "a 16-row tp:2 step kept YNNPACK dots"


def test_bf16_steps_keep_ynnpack_dots():
    engine = Engine.from_pretrained("tiny", dtype="bfloat16", max_running_requests=8)
    assert _YNN in _step_text(engine, (8, 1)), "a bf16 8-row step lost YNNPACK dots"
