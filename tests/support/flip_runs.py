"""Requests run to the end by `step()`, with a flip after a given step: the straight-run
comparison the flip tests make."""

from __future__ import annotations

from flipjax import Engine, SamplingParams


def run_with_flip(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    flip_at: int | None = None,
    target: str = "",
) -> list[list[int]]:
    """Each prompt's tokens, with `engine.flip(target)` before step `flip_at` (None: none)."""
    ids = [engine.add_request(p, params) for p in prompts]
    done, step = {}, 0
    while engine.has_unfinished():
        if step == flip_at:
            engine.flip(target)
        done.update({o.request_id: o for o in engine.step()})
        step += 1
    return [done[i].token_ids for i in ids]
