"""An int8 engine with fp8 KV pages on every layout: the same tokens as the one-device engine in
the same dtypes, through a live flip too (the flip moves int8 weights, fp8 pages and their
scales, never widened ones); no program widens a whole int8 weight; the weights take about a
quarter of their fp32 bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from flipjax import Engine, SamplingParams
from tests.support.flip_runs import run_with_flip
from tests.support.hlo_checks import widened_whole
from tests.support.internals import parts

OPTIONS = dict(
    num_pages=128,
    max_running_requests=4,
    max_prefill_tokens=32,
    quantization="int8",
    kv_cache_dtype="fp8_e4m3",
)
PROMPTS = [[(i * 13 + j) % 250 for i in range(40)] for j in range(2)]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def single() -> Engine:
    return Engine.from_pretrained("tiny", **OPTIONS)


def assert_int8_is_read_as_int8(engine: Engine, prefill: bool = False) -> None:
    """Decode (and prefill) programs of the live layout read int8 in the kernels: the
    projections' at decode's rows, XLA's GEMM a block at a time beyond (per device, at 64 rows,
    in `tests/kernels/test_native_int8.py`), the experts' at every size."""
    binding = parts(engine).runner.binding
    for shape in [(4, 1), (1, 64)] if prefill else [(4, 1)]:
        step, _ = binding.programs(0, shape)
        text = step.as_text()
        assert "flipjax_ragged_matmul_int8" in text
        assert ("flipjax_matmul_int8" in text) == (shape[1] == 1), shape
        assert widened_whole(text) == [], shape


def test_tp_and_a_flip_to_a_pipeline_give_the_one_device_tokens(single):
    straight = run_with_flip(single, PROMPTS, GREEDY)
    assert_int8_is_read_as_int8(single, prefill=True)
    engine = Engine.from_pretrained("tiny", layout="tp:2", **OPTIONS)
    engine.arm("pp:4,4@2,2")
    flat = nnx.to_flat_state(parts(engine).runner.binding.params)
    specs = {".".join(map(str, k)): tuple(v.sharding.spec) for k, v in flat}
    # Each device keeps the scales of its own columns; a row split keeps them whole.
    assert specs["model.layers.3.self_attn.q_proj.scale"] == ("tp",)
    assert specs["model.layers.3.self_attn.q_proj.kernel"] == (None, "tp")
    assert specs["model.layers.3.self_attn.o_proj.scale"] in ((), (None,))
    assert_int8_is_read_as_int8(engine)
    assert run_with_flip(engine, PROMPTS, GREEDY, 3, "pp:4,4@2,2") == straight
    assert_int8_is_read_as_int8(engine)
    flat = nnx.to_flat_state(parts(engine).runner.binding.params)
    leaves = {".".join(map(str, k)): v for k, v in flat}
    # After the flip the int8 weights and their scales are still int8 and fp32.
    experts = [n for n in leaves if n.endswith("experts.gate_proj")]
    assert experts and all(leaves[n].dtype == jnp.int8 for n in experts)
    assert all(leaves[n + "_scale"].dtype == jnp.float32 for n in experts)
    pages = parts(engine).runner.state.kv[0]
    assert pages.k.dtype == jnp.float8_e4m3fn and pages.k_scale.dtype == jnp.float32
    assert len(pages.k_scale.sharding.device_set) == 2  # the pipeline's second stage
    engine.check()


def test_the_check_finds_a_widened_weight():
    """The check itself, on XLA's own dot of a widened int8 weight."""
    program = jax.jit(lambda x, q: x @ q.astype(jnp.float32)).lower(
        jnp.ones((4, 64)), jnp.ones((64, 128), jnp.int8)
    )
    assert len(widened_whole(program.compile().as_text())) == 1


def test_the_weights_take_about_a_quarter_of_their_fp32_bytes(single):
    fp32 = Engine.from_pretrained("tiny", num_pages=32).memory()
    (w32,) = [d.bytes["weights"] for d in fp32.devices]
    (w8,) = [d.bytes["weights"] for d in single.memory().devices]
    assert 0.2 < w8 / w32 < 0.45  # the head and embedding stay fp32


def test_the_bytes_int8_saves_become_kv_pages_within_the_same_budget():
    """Pool sizing prices the int8 weights: what they save goes to the KV pool."""
    options = dict(device_memory="32MiB", max_running_requests=2, max_prefill_tokens=16)
    lines = {}
    for q in (None, "int8"):
        engine = Engine.from_pretrained("tiny", quantization=q, **options)
        (lines[q],) = engine.memory().devices
    saved = lines[None].bytes["weights"] - lines["int8"].bytes["weights"]
    gained = lines["int8"].bytes["kv_pages"] - lines[None].bytes["kv_pages"]
    assert saved > 0 and abs(gained - saved) < 0.05 * saved
