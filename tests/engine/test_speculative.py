"""Speculative decoding with the MTP head gives the tokens of decoding without drafts: greedy
and seeded sampling, stops inside an accepted run, logprobs, and the GDN state left after each
step equal to a plain run's at the same token, with a trained head and one that is always
wrong."""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
import pytest

from flipjax import Engine, SamplingParams
from flipjax.config.tree import FlipjaxConfig
from flipjax.engine.loader import load
from flipjax.runtime.grammar import GrammarCompiler
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned
from tests.support.speculation import MODEL, OPTIONS, PROMPTS, plain, speculative


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    # The plain engine takes each token in before its next step, so the two can be compared
    # at every token (overlap changes no token, only when the host sees it).
    return plain(overlap=False), speculative(3)


def _spec_counts(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats().speculative
    assert s is not None
    return s.verify_rows, s.drafted, s.accepted


def test_greedy_tokens_equal_decoding_without_drafts(engines):
    base, spec = engines
    for prompts in (PROMPTS[:1], PROMPTS):  # one row, and a batch of six
        rows0, drafted0, accepted0 = _spec_counts(spec)
        want = [o.token_ids for o in base.generate(prompts, max_new_tokens=40)]
        got = [o.token_ids for o in spec.generate(prompts, max_new_tokens=40)]
        assert got == want
        rows, drafted, accepted = _spec_counts(spec)
        # Both ways a step can end were taken: drafts kept, and drafts replaced.
        assert 0 < accepted - accepted0 < drafted - drafted0
        assert rows - rows0 < sum(len(t) for t in want)  # fewer steps than tokens
    assert_pools_returned(spec)  # the draft slots too


def test_stats_describe_accept_lengths_and_acceptance_per_position(engines):
    _, spec = engines
    spec.generate(PROMPTS[:2], max_new_tokens=24)
    s = spec.stats().speculative
    assert s.num_steps == 3 and len(s.drafted_at) == len(s.accepted_at) == 3
    assert sum(s.accept_lengths.values()) == s.verify_rows
    assert set(s.accept_lengths) <= {1, 2, 3, 4}
    assert s.accepted == sum(s.accepted_at) and s.drafted == sum(s.drafted_at)
    # A draft at position i + 1 is checked only where the one at i was.
    assert all(a >= b for a, b in zip(s.accepted_at, s.accepted_at[1:], strict=False))
    assert 1.0 < s.mean_accept_length <= 4.0


def test_seeded_sampling_gives_the_same_tokens(engines):
    base, spec = engines
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=32) for seed in range(4)
    ]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=32, repetition_penalty=1.3))
    prompts = PROMPTS[:5]
    want = [o.token_ids for o in base.generate(prompts, sampling=params)]
    got = [o.token_ids for o in spec.generate(prompts, sampling=params)]
    assert got == want


def test_bf16_verify_steps_give_decodings_logprobs_bit_for_bit():
    """In bf16 a verify step rounds each position as a decode step does (flipjax turns off
    XLA's excess precision), so not only the tokens but every logprob is decoding's."""
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    base, spec = plain(dtype="bfloat16", overlap=False), speculative(3, dtype="bfloat16")
    want = base.generate(PROMPTS[:2], sampling=params)
    got = spec.generate(PROMPTS[:2], sampling=params)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [e.logprob for e in g.logprobs] == [e.logprob for e in w.logprobs]
    assert spec.stats().speculative.accepted > 0


def _chi_square(a: list[int], b: list[int]) -> float:
    """Pearson's statistic for two samples of one categorical variable coming from the same
    distribution (a 2 x categories table, categories with no draws left out)."""
    total = [x + y for x, y in zip(a, b, strict=True)]
    n_a, n_b, n = sum(a), sum(b), sum(a) + sum(b)
    return sum(
        (obs - rows * col / n) ** 2 / (rows * col / n)
        for col, x, y in zip(total, a, b, strict=True)
        if col
        for obs, rows in ((x, n_a), (y, n_b))
    )


def test_sampled_tokens_keep_the_model_s_distribution(engines):
    """Over 64 seeds at temperature 1, the second and third tokens (drawn by a verify step) are
    distributed as without drafts: a chi-square test over each one's four likeliest values and
    the rest. An acceptance that keeps a draft without drawing against it fails it."""
    base, spec = engines
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=3) for seed in range(64)]
    plain_runs, spec_runs = (
        [o.token_ids for o in engine.generate([PROMPTS[0]] * 64, sampling=params)]
        for engine in (base, spec)
    )
    for i in (1, 2):
        plain_draws, spec_draws = [t[i] for t in plain_runs], [t[i] for t in spec_runs]
        top = [t for t, _ in Counter(plain_draws).most_common(4)]
        assert len(top) == 4  # a spread distribution, or the test could tell nothing apart

        def counts(draws: list[int], top: list[int] = top) -> list[int]:
            return [draws.count(t) for t in top] + [sum(d not in top for d in draws)]

        assert _chi_square(counts(plain_draws), counts(spec_draws)) < 18.47  # df 4, p = 0.001


def test_stops_and_max_tokens_inside_an_accepted_run_end_exactly_there(engines):
    base, spec = engines
    free = base.generate(PROMPTS[:3], max_new_tokens=40)
    for out in free:
        ids, text = out.token_ids, out.text
        cases = [
            SamplingParams.greedy().replace(max_tokens=7),
            SamplingParams.greedy().replace(max_tokens=40, stop_token_ids=[ids[9]]),
            SamplingParams.greedy().replace(max_tokens=40, stop=[text[len(text) // 2 :][:3]]),
            SamplingParams.greedy().replace(max_tokens=13, logprobs=2),
            SamplingParams.greedy().replace(max_tokens=9, prompt_logprobs=2),
        ]
        for params in cases:
            [a] = base.generate([out.prompt_token_ids], sampling=params)
            [b] = spec.generate([out.prompt_token_ids], sampling=params)
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            if params.prompt_logprobs:  # scored while prefilling, which also feeds the head
                for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
                    assert x.token_id == y.token_id
                    np.testing.assert_allclose(x.logprob, y.logprob, atol=1e-4)
            if params.logprobs:
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.token_id == y.token_id
                    np.testing.assert_allclose(x.logprob, y.logprob, atol=1e-4)
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]
    spec.check()


def _states_match_a_plain_run(base: Engine, spec: Engine, prompt: str, tokens: int) -> int:
    """Step one request through both engines; wherever they have computed the same number of
    tokens, the request's GDN slot holds the same state. Returns how many points compared."""
    a = base.add_request(prompt, max_new_tokens=tokens)
    b = spec.add_request(prompt, max_new_tokens=tokens)
    pa, pb = parts(base), parts(spec)
    compared = 0
    while spec.has_unfinished():
        spec.step()
        if b not in pb.requests.ids():
            break
        seq_b = pb.requests[b]
        while pa.requests[a].num_computed < seq_b.num_computed:
            base.step()
        seq_a = pa.requests[a]
        known = seq_b.num_computed + 1
        assert seq_a.all_ids[:known] == seq_b.all_ids[:known]
        if seq_a.num_computed == seq_b.num_computed:
            for x, y in zip(
                pa.runner.read_slot(seq_a.slot), pb.runner.read_slot(seq_b.slot), strict=True
            ):
                np.testing.assert_allclose(y, x, atol=2e-5, rtol=1e-4)
            compared += 1
    while base.has_unfinished():
        base.step()
    return compared


def test_the_state_after_a_step_is_a_plain_run_s_at_the_same_token(engines):
    base, spec = engines
    _, drafted0, accepted0 = _spec_counts(spec)
    assert _states_match_a_plain_run(base, spec, PROMPTS[4], 40) >= 10
    _, drafted, accepted = _spec_counts(spec)
    assert 0 < accepted - accepted0 < drafted - drafted0


def _always_wrong_head_engine() -> Engine:
    """The shipped model with an MTP head whose final norm scales by zero (the norm is
    zero-centred: x * (1 + w)): its logits are all zero, so every draft is token 0 (end of
    text), which these prompts never reach."""
    loaded = load(MODEL, "float32", draft_head=True)
    head = loaded.draft_head
    head.norm.weight[...] = -jax.numpy.ones_like(head.norm.weight[...])
    config = FlipjaxConfig.build(
        model=MODEL,
        speculative_algorithm="MTP",
        speculative_num_steps=2,
        speculative_adaptive=False,
        **OPTIONS,
    )
    return Engine(loaded.model, loaded.tokenizer, config, draft_head=head)


def test_a_head_that_is_always_wrong_changes_no_token_nor_state(engines):
    base, _ = engines
    wrong = _always_wrong_head_engine()
    want = [o.token_ids for o in base.generate(PROMPTS[:4], max_new_tokens=24)]
    assert not any(0 in t for t in want)
    got = [o.token_ids for o in wrong.generate(PROMPTS[:4], max_new_tokens=24)]
    assert got == want
    assert _states_match_a_plain_run(base, wrong, PROMPTS[1], 24) >= 20
    rows, drafted, accepted = _spec_counts(wrong)
    assert drafted > 0 and accepted == 0
    assert wrong.stats().speculative.accept_lengths.keys() == {1}
    assert_pools_returned(wrong)


def test_a_grammar_request_decodes_without_drafts_and_unchanged(engines):
    base, spec = engines
    grammars = GrammarCompiler(spec.info.tokenizer, spec.info.model.vocab_size)
    compiled = grammars.compile("regex", "[a-z_]{4,12}\\(")
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=16)
    _, drafted0, _ = _spec_counts(spec)
    outs = []
    for engine in (base, spec):
        rid = engine.add_request("def ", params, grammar=grammars.constraint(compiled))
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[0].token_ids == outs[1].token_ids and outs[1].text.endswith("(")
    assert _spec_counts(spec)[1] == drafted0
    assert_pools_returned(spec)


def test_the_adaptive_policy_switches_ways_mid_run_and_keeps_every_token(engines):
    base, _ = engines
    adaptive = speculative(3, speculative_adaptive=True)
    want = [o.token_ids for o in base.generate(PROMPTS, max_new_tokens=40)]
    got = [o.token_ids for o in adaptive.generate(PROMPTS, max_new_tokens=40)]
    assert got == want
    s = adaptive.stats().speculative
    assert s.verify_rows > 0 and s.plain_steps > 0 and s.switches > 0  # both ways measured
    assert_pools_returned(adaptive)


def test_a_verify_step_stops_at_each_gdn_grid_point_so_its_state_is_cached():
    """The device prefix cache keeps GDN states on a grid (every 16 tokens here): a verify step
    never runs past a grid point, so a speculating request leaves a state at every one it
    passed, as decoding token by token does."""
    engine = speculative(3, gdn_checkpoint_interval=16)
    [out] = engine.generate([PROMPTS[2]], max_new_tokens=70)
    computed = len(out.prompt_token_ids) + len(out.token_ids) - 1  # the last token is not fed
    assert parts(engine).prefix_cache.num_states == computed // 16
    assert engine.stats().speculative.accepted > 0


def test_a_warmed_up_engine_compiles_nothing_as_it_speculates():
    """Warm-up compiles the verify step's sampler input and the head's drafting after it with
    the shardings a step gives them, so the first request does not wait on a compile."""
    spec = speculative(3, max_running_requests=2, max_prefill_tokens=64)
    spec.warmup()
    warm = spec.stats().compiles
    spec.generate(PROMPTS[:2], max_new_tokens=12)
    spec.generate(PROMPTS[:1], max_new_tokens=12)
    assert spec.stats().compiles == warm
