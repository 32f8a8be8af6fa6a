"""A fault in one request's own work fails that request only.

Faults are injected into each stage of a request's host work: seeding its prefix as it is
admitted, building its sampler row, taking its token in (grammar, text, stops) and publishing
its pages. The request beside it, decoding in the same batches, must produce exactly the
tokens it produces alone, and the failed request must free everything it held.
"""

from __future__ import annotations

import functools

import pytest

import flipjax.engine.step as step_module
from flipjax import Engine, SamplingParams
from flipjax.engine.faults import STAGES
from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.sequence import Sequence
from flipjax.engine.step import Stepper
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned

VICTIM_SEED = 4242
BESIDE = [(i * 5 + 1) % 256 for i in range(40)]
VICTIM = [(i * 3 + 2) % 256 for i in range(40)]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained("tiny", max_running_requests=4, max_prefill_tokens=32)


@pytest.fixture(scope="module")
def solo(engine):
    [out] = engine.generate([BESIDE], max_new_tokens=12)
    return out.token_ids


def faulty(work, after: int = 0):
    """`work`, raising for the victim's request once it has `after` tokens."""

    @functools.wraps(work)
    def wrapped(*args, **kwargs):
        seq = next(a for a in args if isinstance(a, Sequence))
        if seq.seed == VICTIM_SEED and len(seq.output_ids) >= after:
            raise RuntimeError("injected fault")
        return work(*args, **kwargs)

    return wrapped


def inject(engine: Engine, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if stage == "admitting":
        scheduler = parts(engine).scheduler
        monkeypatch.setattr(scheduler, "on_admit", faulty(scheduler.on_admit))
    elif stage == "sampling":  # mid-decode, with the beside request in the same rows
        monkeypatch.setattr(Stepper, "row", faulty(Stepper.row, after=3))
    elif stage == "detokenizing":
        monkeypatch.setattr(step_module, "append_token", faulty(step_module.append_token, 2))
    else:
        monkeypatch.setattr(PrefixReuse, "publish", faulty(PrefixReuse.publish, after=4))


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_fails_its_request_and_the_one_beside_goes_on(engine, solo, stage, monkeypatch):
    before = engine.stats().faults.get(stage, 0)
    inject(engine, stage, monkeypatch)
    victim = SamplingParams(max_tokens=12, temperature=0.8, seed=VICTIM_SEED)
    beside, failed = engine.generate([BESIDE, VICTIM], 12, [SamplingParams.greedy(), victim])
    assert beside.token_ids == solo and beside.error is None
    assert failed.finish_reason == "error" and failed.text == ""
    assert f"internal error while {stage}" in failed.error and "injected fault" in failed.error
    assert "reference err-" in failed.error
    assert engine.stats().faults[stage] == before + 1
    monkeypatch.undo()
    assert_pools_returned(engine)
    [again] = engine.generate([VICTIM], 12, victim)  # the engine serves it once the fault is gone
    assert again.error is None and again.finish_reason in ("length", "stop")
