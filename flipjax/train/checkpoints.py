"""Training checkpoints, by orbax: step, parameters, optimizer state and data position.

Orbax writes each checkpoint under a temporary name and renames it into place once complete,
so a run killed mid-save leaves the previous checkpoint as the newest one `latest_step` finds.
A checkpoint whose parameters are not all finite is refused before anything is written.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from flipjax.train.batches import DataPosition

KEEP = 3


class TrainCheckpoints:
    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.folder, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, data: DataPosition) -> None:
        if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params)):
            raise FloatingPointError(f"step {step}: parameters are not finite; not saved")
        item = {
            "params": params,
            "opt_state": opt_state,
            "data": {"epoch": np.int64(data.epoch), "index": np.int64(data.index)},
        }
        self._manager.save(step, args=ocp.args.StandardSave(item))
        self._manager.wait_until_finished()

    def restore(self, step: int, params: Any, opt_state: Any) -> tuple[Any, Any, DataPosition]:
        """Checkpoint `step` read into the structure, dtypes and shardings of `params` and
        `opt_state` (arrays, or shape-dtype structs)."""

        def target(x: Any) -> Any:
            if not hasattr(x, "shape"):
                return x
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        abstract = jax.tree.map(
            target,
            {
                "params": params,
                "opt_state": opt_state,
                "data": {"epoch": np.int64(0), "index": np.int64(0)},
            },
        )
        item = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        data = DataPosition(int(item["data"]["epoch"]), int(item["data"]["index"]))
        return item["params"], item["opt_state"], data

    def close(self) -> None:
        self._manager.close()
