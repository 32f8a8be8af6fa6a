"""A speculative verify step's matmuls take the path its decode step takes (`step_rows`): the
native matmul where the calibration gives it the decode step's rows, though the verify step has
K + 1 times as many, so both compute each row alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas import dispatch, head_parallel, step_rows


@pytest.mark.parametrize("dtype", [jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)])
def test_a_verify_step_s_rows_choose_as_its_decode_step_s(monkeypatch, dtype):
    monkeypatch.setenv("FLIPJAX_NATIVE_MATMUL_ROWS", "float32=1-8,bfloat16=1-8")
    one_device = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with dispatch.kernels("native"), head_parallel.across(one_device):
        assert dispatch.matmul(8, 1024, dtype) is not None  # a decode step of 8 rows
        assert dispatch.matmul(32, 1024, dtype) is None  # 32 rows of a decode step: XLA's dot
        with step_rows.positions_per_row(4):  # 8 rows of 4 positions: as the 8-row step
            assert dispatch.matmul(32, 1024, dtype) is not None
            assert dispatch.matmul(36, 1024, dtype) is None  # a 9-row step's choice
        int8 = dispatch.int8_matmul(32, dtype)
        with step_rows.positions_per_row(4):
            assert dispatch.int8_matmul(32, dtype) is not int8  # native, as 8 rows take
