"""Prompt chunks of several requests prefilled in one call (`max_prefill_rows`): which chunks a
step puts together, and the tokens, which are those of each request prefilled alone."""

from __future__ import annotations

import numpy as np
import pytest

from flipjax import Engine, SamplingParams
from flipjax.engine.scheduler import PrefillChunk
from flipjax.engine.sequence import Sequence
from flipjax.engine.step import prefill_calls
from flipjax.runtime.buckets import prefill_rows
from flipjax.runtime.model_runner import Row
from tests.support.internals import parts


def _chunk(name: str, length: int, start: int = 0, scoring: bool = False) -> PrefillChunk:
    params = SamplingParams(prompt_logprobs=1 if scoring else None)
    seq = Sequence(name, list(range(start + length)), params, max_tokens=4, seed=0)
    return PrefillChunk(seq, start, length)


def _names(calls: list[list[PrefillChunk]]) -> list[list[str]]:
    return [[c.seq.request_id for c in call] for call in calls]


def test_a_run_of_one_bucket_goes_in_power_of_two_calls_and_the_rest_alone():
    chunks = [_chunk(n, 16) for n in "abcde"]
    chunks += [_chunk("f", 100), _chunk("g", 120), _chunk("h", 16, scoring=True), _chunk("i", 9)]
    chunks += [_chunk("j", 16), _chunk("k", 16)]
    calls = prefill_calls(chunks, {16: 4, 128: 2})
    # e stays out of a's call (it is full), f and g share a bucket, h scores (alone), and the
    # run i (9 tokens: bucket 16), j, k is a call of two and one: no call computes a padding row.
    want = [["a", "b", "c", "d"], ["e"], ["f", "g"], ["h"], ["i", "j"], ["k"]]
    assert _names(calls) == want
    assert [c for call in calls for c in call] == chunks  # every chunk once, in plan order


def test_a_requests_next_chunk_goes_in_a_later_call():
    first, other = _chunk("a", 16), _chunk("b", 16)
    second = PrefillChunk(first.seq, 16, 16)  # continues the state `first` leaves
    calls = prefill_calls([first, second, other], {16: 4})
    assert [[id(c) for c in call] for call in calls] == [[id(first)], [id(second), id(other)]]


def test_prefill_rows_keep_a_call_within_its_budgets():
    assert prefill_rows(16, 4, 2048) == 4
    assert prefill_rows(16, 6, 2048) == 4  # a power of two
    assert prefill_rows(256, 8, 2048) == 4  # at most 1024 positions
    assert prefill_rows(64, 8, 128) == 2  # at most the step's prefill budget
    assert prefill_rows(1024, 8, 2048) == 1


PROMPTS = [[(i * 11 + 5 * n) % 251 for i in range(20 + n)] for n in range(7)]  # bucket 32


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    engine = Engine.from_pretrained("tiny", max_prefill_rows=1, max_prefill_tokens=256)
    assert parts(engine).runner.prefill_rows[32] == 1
    return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)]


@pytest.mark.parametrize("layout", ["single", "pp:5,3"])
def test_prompts_prefilled_together_give_the_tokens_each_gets_alone(alone, layout):
    engine = Engine.from_pretrained("tiny", layout=layout, max_prefill_tokens=256)
    assert parts(engine).runner.prefill_rows[32] == 4  # the default: four rows of 32
    engine.warmup()
    warm = engine.stats().compiles
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)] == alone
    assert parts(engine).stepper.prefill_calls == {4: 1, 2: 1, 1: 1}  # 7 = 4 + 2 + 1
    assert engine.stats().compiles == warm  # every call's shape was warmed
    engine.check()


def _with_choices(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6)  # greedy: prompts tell apart
    ids = [engine.add_request(PROMPTS[0], params)]
    parent = engine.add_request(PROMPTS[2], params, n=2)  # the second row of a call of two
    ids += [*engine.progress(parent).choices, engine.add_request(PROMPTS[1], params)]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return [outs[i].token_ids for i in ids]


def test_a_prompts_choices_fork_from_its_row_of_a_call():
    alone = Engine.from_pretrained("tiny", max_prefill_rows=1, max_prefill_tokens=256)
    together = Engine.from_pretrained("tiny", max_prefill_tokens=256)
    assert _with_choices(together) == _with_choices(alone)
    assert parts(together).stepper.prefill_calls == {2: 1, 1: 1}
    together.check()


def test_each_row_of_a_call_gets_the_logits_of_its_chunk_alone():
    """To rounding: XLA's GEMM rounds a product of more rows differently (about 1e-5 here)."""
    runner = parts(Engine.from_pretrained("tiny", max_prefill_tokens=128)).runner
    rows = [Row(p, 0, [2 * i, 2 * i + 1], i) for i, p in enumerate(PROMPTS[:4])]
    together = np.asarray(runner.run(rows, decode=False))
    alone = np.concatenate([np.asarray(runner.run([r], decode=False)) for r in rows])
    np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-4)
    assert np.abs(alone[1:] - alone[0]).max() > 1e-2  # the rows are not one another's


def test_a_prefill_of_more_rows_than_its_bucket_takes_is_refused():
    engine = Engine.from_pretrained("tiny", max_prefill_tokens=64)
    runner = parts(engine).runner
    assert runner.prefill_rows == {16: 4, 32: 2, 64: 1}
    rows = [Row(list(range(20)), 0, [i], i) for i in range(3)]
    with pytest.raises(ValueError, match="prefill of 3 rows of 32 tokens: at most 2"):
        runner.run(rows, decode=False)


def test_max_prefill_rows_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="max_prefill_rows: must be a power of two, got 3"):
        Engine.from_pretrained("tiny", max_prefill_rows=3)
