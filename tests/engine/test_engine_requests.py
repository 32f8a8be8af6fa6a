"""What a request can ask of the engine beyond plain sampling: parallel choices that fork from
one prefill, prompt logprobs, logit bias, min_tokens and grammar constraints.

The references are the engine's own straight-through runs (a choice alone with its seed) and
the contiguous forward's log-softmax, which is checked against transformers elsewhere.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from flipjax import Engine, SamplingParams
from flipjax.runtime.grammar import GrammarCompiler
from tests.support.internals import prompt_logits
from tests.support.pool_checks import assert_pools_returned

PS = 16


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained("tiny", max_running_requests=8, max_prefill_tokens=64)


def prompt(n: int) -> list[int]:
    return [(i * 7 + 3) % 256 for i in range(n)]


def run(engine: Engine, rid: str) -> dict[str, object]:
    """Step until everything finished; the outputs by id and the prefill tokens computed."""
    outs, prefilled = {}, 0
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
        prefilled += engine.last_step.prefill_tokens
    return {"outs": outs, "prefilled": prefilled}


@pytest.mark.parametrize("length", [45, 48])  # a partly filled last page, and a full one
def test_choices_fork_from_one_prefill(engine, length):
    ids = prompt(length)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=7)
    rid = engine.add_request(ids, params, n=4)
    choices = engine.progress(rid).choices
    done = run(engine, rid)
    assert done["prefilled"] == length, "the prompt is computed once for all four choices"
    alone = [engine.generate([ids], sampling=params.replace(seed=11 + i))[0] for i in range(4)]
    assert [done["outs"][c].token_ids for c in choices] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1, "choices must differ"
    assert [done["outs"][c].cached_tokens for c in choices[1:]] == [length] * 3
    engine.check()
    engine.flush_prefix_cache()
    assert_pools_returned(engine)


def test_an_aborted_parent_leaves_its_choices_to_compute_alone(engine):
    ids = prompt(40)
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=4)
    rid = engine.add_request(ids, params, n=3)
    choices = engine.progress(rid).choices
    engine.abort(rid)  # before its prompt ran: the other two queue on their own
    outs = run(engine, rid)["outs"]
    alone = [engine.generate([ids], sampling=params.replace(seed=3 + i))[0] for i in (1, 2)]
    assert [outs[c].token_ids for c in choices[1:]] == [a.token_ids for a in alone]
    engine.flush_prefix_cache()
    assert_pools_returned(engine)


def test_too_many_choices_are_refused(engine):
    with pytest.raises(ValueError, match="n: 9 choices exceed max_running_requests"):
        engine.add_request("x", n=9)
    assert not engine.has_unfinished()


def reference_logprobs(engine: Engine, ids: list[int]) -> np.ndarray:
    logits = prompt_logits(engine, ids)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_prompt_logprobs_are_the_forward_log_softmax(engine):
    ids = prompt(45)
    engine.generate([ids], max_new_tokens=2)  # the prompt is now cached: scoring must not reuse
    scored = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)
    out = engine.generate([ids], sampling=scored)[0]
    lsm = reference_logprobs(engine, ids)
    assert out.token_ids == [] and out.finish_reason == "length" and out.cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    got = np.array([e.logprob for e in out.prompt_logprobs[1:]])
    np.testing.assert_allclose(got, lsm[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    top = out.prompt_logprobs[5].top
    assert [t for t, _ in top] == list(np.argsort(-lsm[4])[:2])


def test_logit_bias_and_min_tokens_hold_the_stop_token_back(engine):
    forced = engine.generate(
        ["abc"],
        sampling=SamplingParams(temperature=0.7, seed=1, max_tokens=5, logit_bias={65: 100.0}),
    )[0]
    assert forced.token_ids == [65] * 5
    stop = SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[66], logit_bias={66: 100.0}, min_tokens=4
    )
    out = engine.generate(["abc"], sampling=stop)[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == 66 and 66 not in out.token_ids[:4]
    assert out.finish_reason == "stop"
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias: token ids"):
        engine.add_request("x", SamplingParams(logit_bias={100000: 1.0}))


@pytest.fixture(scope="module")
def grammars(engine):
    return GrammarCompiler(engine.info.tokenizer, engine.info.model.vocab_size)


def test_every_choice_follows_its_grammar(engine, grammars):
    compiled = grammars.compile("choice", ["yes", "no", "maybe"])
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=12)
    rid = engine.add_request("answer: ", params, n=4, grammar=grammars.constraint(compiled))
    choices = engine.progress(rid).choices
    outs = run(engine, rid)["outs"]
    assert all(outs[c].text in ("yes", "no", "maybe") for c in choices)
    assert all(outs[c].finish_reason == "stop" for c in choices)


def test_a_json_schema_holds_for_every_seed(engine, grammars):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["ok", "n"],
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
    }
    compiled = grammars.compile("json", schema)
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200)
        rid = engine.add_request("json: ", params, grammar=grammars.constraint(compiled))
        text = run(engine, rid)["outs"][rid].text
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 99


def test_bounded_strings_stay_strict_json(engine, grammars):
    """xgrammar's length-bounded JSON strings admit raw control characters unless patched;
    strict parsers (json.loads) refuse those."""
    schema = {
        "type": "object",
        "required": ["s"],
        "additionalProperties": False,
        "properties": {"s": {"type": "string", "minLength": 4, "maxLength": 12}},
    }
    compiled = grammars.compile("json", schema)
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200)
        rid = engine.add_request("json: ", params, grammar=grammars.constraint(compiled))
        value = json.loads(run(engine, rid)["outs"][rid].text)
        assert isinstance(value["s"], str) and not any(ord(ch) < 32 for ch in value["s"])


def test_grammar_rows_compile_nothing_after_warmup(grammars):
    engine = Engine.from_pretrained("tiny", max_running_requests=2, max_prefill_tokens=32)
    engine.warmup()
    compiled = grammars.compile("regex", "[a-z]{6}")
    count = engine.stats().compiles
    for params in (SamplingParams.greedy(8), SamplingParams(top_p=0.9, seed=1, max_tokens=8)):
        rid = engine.add_request("x", params, grammar=grammars.constraint(compiled))
        assert len(run(engine, rid)["outs"][rid].text) == 6
    assert engine.stats().compiles == count


def test_a_bad_grammar_is_refused_by_name(grammars):
    with pytest.raises(ValueError, match=r"guided_regex: invalid regex"):
        grammars.compile("regex", "(", "guided_regex")
    with pytest.raises(ValueError, match="response_format: invalid json"):
        grammars.compile("json", {"type": "objectx"})
    assert grammars.counters["refused"] == 2
