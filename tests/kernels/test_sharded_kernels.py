"""The Pallas kernels under a sharded layout: each device runs its own shard of heads.

A kernel is opaque to the partitioner, so without `shard_map` around it every device would be
handed whole pools. These run the kernels in interpret mode on the CPU mesh: the tokens on one
device, under TP and under a two-device-stage pipeline are the pure-JAX reference's, and no
compiled step gathers a head-sharded pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flipjax import Engine
from kernels_pallas import dispatch, head_parallel
from kernels_pallas.paged_attention.pallas_kernel import ragged_paged_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference
from tests.support.internals import parts
from tests.support.kernel_cases import paged_case
from tests.support.pool_gathers import gathers_of_pools

OPTIONS = dict(num_pages=64, max_running_requests=2, max_prefill_tokens=32)
PROMPTS = [[(i * 11 + 5) % 256 for i in range(n)] for n in (3, 40)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = Engine.from_pretrained("tiny", **OPTIONS)
    return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)]


@pytest.fixture(scope="module")
def engines():
    """One engine per layout, its kernels interpreted; built on first use."""
    built: dict[str, Engine] = {}

    def get(layout: str) -> Engine:
        if layout not in built:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(dispatch.KERNELS_ENV, "interpret")
                built[layout] = Engine.from_pretrained("tiny", layout=layout, **OPTIONS)
        return built[layout]

    return get


# One device runs the same kernel calls as `test_kernels.py`'s checks against the references;
# these are the layouts that wrap them (heads split per device, stages on their own devices).
@pytest.mark.parametrize("layout", ["tp:2", "pp:4,4@2,2"])
def test_every_sharded_layout_with_kernels_gives_the_reference_tokens(engines, reference, layout):
    engine = engines(layout)
    assert parts(engine).runner.kernels == "interpret"
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)] == reference
    engine.check()


def test_a_tp_step_never_gathers_a_sharded_pool(engines):
    engine = engines("tp:2")
    for shape in ((2, 1), (1, 16)):  # a decode step (paged attention, GDN step), a prefill chunk
        assert gathers_of_pools(engine, shape) == [], shape


@pytest.mark.parametrize("devices", [2, 4])  # 2: KV heads split; 4: replicated, sliced per device
def test_head_parallel_attention_is_the_reference_on_every_device_count(devices):
    q, k, v, table, positions = paged_case(3, [(37, 1), (20, 1), (9, 9)], 2, 2, 8, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))
    heads = NamedSharding(mesh, P(None, None, "tp", None))
    kv = heads if devices == 2 else NamedSharding(mesh, P())
    kernel = functools.partial(ragged_paged_attention, interpret=True)
    run = jax.jit(head_parallel.attention(kernel, mesh))
    got = run(
        jax.device_put(q, heads), jax.device_put(k, kv), jax.device_put(v, kv), table, positions
    )
    want = paged_attention_reference(q, k, v, table, positions)
    valid = np.asarray(positions >= 0)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)
