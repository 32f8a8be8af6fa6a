"""Overlapped decoding gives the tokens of step-by-step decoding.

The reference is the same engine with `overlap=False`: every step takes its sampled ids in
before the next is dispatched. The batches mix what depends on the ids just drawn (penalties,
min_tokens, logprobs, stop ids and strings, a grammar) and rows that stop at different steps,
and the tests interrupt a batch running ahead with an abort, a new request, a checkpoint-free
flip and the pool checks.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flipjax import Engine, SamplingParams
from flipjax.runtime.grammar import GrammarCompiler
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned


def make(overlap: bool) -> Engine:
    engine = Engine.from_pretrained(
        "tiny", overlap=overlap, max_running_requests=8, max_prefill_tokens=32
    )
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def engines() -> dict[bool, Engine]:
    return {False: make(False), True: make(True)}


def prompt(i: int) -> list[int]:
    return [(j * 11 + 5 * i + 1) % 256 for j in range(20 + 3 * i)]


def mixed(stop_id: int) -> list[SamplingParams]:
    """Rows whose next draw depends on the ids drawn so far, ending at different steps."""
    return [
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0.9, seed=1, max_tokens=23, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=2, max_tokens=17, presence_penalty=0.8, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        SamplingParams(temperature=1.0, seed=4, max_tokens=14, min_tokens=10, frequency_penalty=1),
        SamplingParams(temperature=0.8, seed=5, max_tokens=26, stop=["ab", "q"]),
    ]


def outcome(engine: Engine, params: list[SamplingParams]) -> tuple[list[tuple], np.ndarray]:
    """What each request returned, and every logprob it reported (to compare within rounding:
    the step after a row stops still runs at the old batch size, whose matmuls may round
    differently in the last bits, as any change of batch composition may)."""
    outs = engine.generate([prompt(i) for i in range(len(params))], sampling=params)
    logprobs = [[lp.logprob, *(v for _, v in lp.top)] for o in outs for lp in o.logprobs or []]
    returned = [
        (o.token_ids, o.finish_reason, o.text, [[i for i, _ in lp.top] for lp in o.logprobs or []])
        for o in outs
    ]
    return returned, np.array(logprobs)


def test_a_mixed_batch_gets_the_tokens_of_step_by_step_decoding(engines):
    straight = engines[False].generate([prompt(3)], max_new_tokens=30)[0].token_ids
    params = mixed(stop_id=straight[12])  # greedy row 3 stops at its 13th token
    reference = outcome(engines[False], params)
    ahead, before = engines[True], parts(engines[True]).overlap.steps
    returned, logprobs = outcome(ahead, params)
    reference, reference_logprobs = reference
    assert returned == reference
    np.testing.assert_allclose(logprobs, reference_logprobs, rtol=1e-5, atol=1e-5)
    assert reference[3][1] == "stop" and len(reference[3][0]) == 13
    assert len({len(r[0]) for r in reference}) >= 4, "rows must stop at different steps"
    assert parts(ahead).overlap.steps - before >= 8, "the batch must have run ahead"
    # Samplers with penalties or logprobs compile on first use (`ModelRunner.warmup`); the
    # batch run again compiles nothing.
    compiles = ahead.stats().compiles
    assert outcome(ahead, params)[0] == reference
    assert ahead.stats().compiles == compiles, "running ahead compiles nothing"
    assert_pools_returned(ahead)


def test_a_grammar_row_runs_ahead_with_the_same_tokens(engines):
    grammars = GrammarCompiler(engines[True].info.tokenizer, engines[True].info.model.vocab_size)
    compiled = grammars.compile("choice", ["yes", "no", "maybe", "perhaps not"])
    texts = {}
    for overlap, engine in engines.items():
        ids = [
            engine.add_request(
                "answer: ",
                SamplingParams(temperature=1.0, seed=s, max_tokens=12),
                grammar=grammars.constraint(compiled),
            )
            for s in range(4)
        ]
        ids.append(engine.add_request(prompt(1), SamplingParams(temperature=0, max_tokens=16)))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step()})
        texts[overlap] = [(done[i].text, done[i].token_ids) for i in ids]
    assert texts[True] == texts[False]
    assert all(t in ("yes", "no", "maybe", "perhaps not") for t, _ in texts[True][:4])


def test_an_abort_and_an_arrival_mid_batch_leave_the_others_unchanged(engines):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=24)
    reference = engines[False].generate([prompt(0), prompt(1), prompt(4)], sampling=sampled)
    late = engines[False].generate([prompt(5)], sampling=greedy)[0]

    engine = engines[True]
    ids = [engine.add_request(prompt(i), sampled) for i in (0, 1, 2, 4)]
    while len(engine.progress(ids[0]).new_ids) < 6:
        engine.step()
    assert parts(engine).overlap.pending is not None, "the batch must be running ahead"
    aborted = engine.abort(ids[2])
    assert aborted.finish_reason == "abort" and parts(engine).overlap.pending is None
    outs = {}
    while len(engine.progress(ids[0]).new_ids) < 12:
        outs.update({o.request_id: o for o in engine.step()})
    late_id = engine.add_request(prompt(5), greedy)
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    got = [outs[i].token_ids for i in (ids[0], ids[1], ids[3])]
    assert got == [r.token_ids for r in reference]
    assert outs[late_id].token_ids == late.token_ids
    assert_pools_returned(engine)


def test_a_request_that_finished_in_flight_is_returned_once(engines):
    engine = engines[True]
    short = engine.add_request(prompt(0), SamplingParams(temperature=0, max_tokens=5))
    long = engine.add_request(prompt(1), SamplingParams(temperature=0, max_tokens=20))
    seen = []
    while len(engine.progress(short).new_ids) < 4:
        seen += engine.step()
    assert parts(engine).overlap.pending is not None, "the short request's last token is in flight"
    engine.check()  # settles: that token finishes it here, outside a step
    out = engine.abort(short)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    while engine.has_unfinished():
        seen += engine.step()
    assert [o.request_id for o in seen] == [long], "the settled request is not returned again"
    assert_pools_returned(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_step_on_one_device_puts_nothing_through_python(engines, monkeypatch, overlap):
    """On one process and one device, a decode step's host inputs go to its program as they
    are, and the ids and logits already on the device stay there: `jax.device_put`'s Python
    path cost a batch-1 step about a millisecond of the host thread, on the cores the
    device's threads use. Sixteen more decode steps make no more puts."""
    engine, real, puts = engines[overlap], jax.device_put, []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(1) or real(*a, **k))
    counts = []
    for max_tokens in (4, 20):
        puts.clear()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = engine.generate([prompt(1)], sampling=params)
        assert len(out.token_ids) == max_tokens
        counts.append(len(puts))
    assert counts[1] == counts[0]


def test_a_flip_mid_batch_continues_exactly(engines):  # the module's last: it moves the engine
    engine = engines[True]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20) for s in range(3)]
    reference = engines[False].generate([prompt(i) for i in range(3)], sampling=params)
    ids = [engine.add_request(prompt(i), p) for i, p in enumerate(params)]
    while len(engine.progress(ids[0]).new_ids) < 7:
        engine.step()
    assert parts(engine).overlap.pending is not None
    engine.flip("tp:2")
    ahead = parts(engine).overlap.steps
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[i].token_ids for i in ids] == [r.token_ids for r in reference]
    assert parts(engine).overlap.steps > ahead, "tensor parallel is one stage: it runs ahead too"
    engine.flip("pp:4,4")
    before = parts(engine).overlap.steps
    out = engine.generate([prompt(0)], sampling=params[0])[0]
    assert out.token_ids == reference[0].token_ids
    assert parts(engine).overlap.steps == before, "a pipeline's steps are cut on the host"
    assert_pools_returned(engine)
