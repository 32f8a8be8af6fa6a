"""Which XLA:CPU matmul library a step program uses, by the height of its matmuls.

XLA:CPU emits dots (and some reductions) as YNNPACK fusions by default, which run a dot of a few
rows on one thread. Without those fusions dots go to Eigen, whose dots use both threads of the
pool, so fp32 matmuls of 8 to 16 rows run faster through Eigen. On the benchmark model the
matmuls alone took 13.0 against 13.9 ms at 8 rows and 15.4 against 18.2 at 16; whole engine steps,
alternated in one process, 27.1 against 30.2 ms at batch 16 and 2-3% less at batch 8. From 32
rows up YNNPACK is faster (26.4 against 32.2 ms at 32 rows), and at up to 4 rows the two are
even. Eigen has no fast bf16 dot (8 rows: 119 against 11.5 ms), so low-precision programs always
keep YNNPACK.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

EIGEN_ROWS = range(8, 17)  # fp32 matmul heights Eigen was measured faster at (8 and 16)


def step_compiler_options(mesh: Mesh, dtype: jnp.dtype, rows: int) -> dict[str, str]:
    """XLA options for a step program over `mesh` whose matmuls have `rows` rows."""
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    if on_cpu and jnp.dtype(dtype) == jnp.float32 and rows in EIGEN_ROWS:
        return {"xla_cpu_experimental_ynn_fusion_type": ""}  # no YNNPACK fusions: Eigen dots
    return {}
