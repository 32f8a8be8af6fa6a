"""The one door the tests have into an engine's inside, beside its public API.

Tests of the parts (the scheduler, the allocator, the runner, the layouts, prefix reuse, the
overlap of decode steps) need to look at what the engine keeps private; they do it through
these functions, so that the architecture test can hold everything else in the project to
`Engine`'s narrow API. Production code never imports this module.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from flipjax.engine.assembly import Parts
from flipjax.engine.engine import Engine


def parts(engine: Engine) -> Parts:
    """Every part of `engine`: allocator, scheduler, runner, layouts, reuse, requests, ..."""
    return engine._parts


def params(engine: Engine) -> nnx.State:
    """The parameters, wherever the current layout placed them (read through the binding)."""
    return engine._parts.runner.params


def prompt_logits(engine: Engine, token_ids: list[int]) -> np.ndarray:
    """Logits for every prompt position, [len(token_ids), vocab] float32, from the contiguous
    reference forward (no pages, no chunks): the path the paged engine is held to."""
    p = engine._parts
    ids = p.requests.encode(token_ids)
    p.requests.check_length(len(ids))
    return p.reference(p.runner.binding, ids)


def replace_draft_weight(engine: Engine, key: str, value: jax.Array) -> None:
    """Swap the speculating engine's draft weight at `key` (a path as `jax.tree_util.keystr`
    writes those of `Drafter.held`) for `value`, as a corrupted checkpoint would give it."""
    drafter = engine._parts.stepper.speculation.drafter
    tree = jax.tree.unflatten(drafter._tree, drafter._params)
    keys = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    drafter._params[keys.index(key)] = jax.device_put(value, drafter.device)
