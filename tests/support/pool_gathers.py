"""Finding, in an engine's compiled step, the all-gathers that would move a whole head-sharded
pool onto every device: what running a kernel per device over its heads exists to avoid."""

from __future__ import annotations

import re

import jax

from flipjax import Engine
from tests.support.internals import parts


def gathers_of_pools(engine: Engine, shape: tuple[int, int]) -> list[str]:
    """The all-gathers in the compiled step of `shape` whose result is a whole pool, or the
    whole (all heads) GDN states of the step's rows."""
    state = parts(engine).runner.state
    pools = {tuple(x.shape) for x in jax.tree.leaves(state)}
    pools |= {(shape[0], *g.recurrent.shape[1:]) for g in state.gdn}
    step, _ = parts(engine).runner.binding.programs(0, shape)
    text = step.as_text()
    found = []
    for line in text.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\S* all-gather", line)
        if m and tuple(int(d) for d in m.group(1).split(",")) in pools:
            found.append(line.strip()[:160])
    return found
