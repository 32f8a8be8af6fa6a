"""Speculative decoding keeps the tokens of decoding without drafts under tensor parallel and an
uneven pipeline, and across live flips between them with requests mid-run."""

from __future__ import annotations

import pytest

from flipjax import SamplingParams
from tests.support.flip_runs import run_with_flip
from tests.support.pool_checks import assert_pools_returned
from tests.support.speculation import PROMPTS, plain, speculative, untied_copy

GREEDY = SamplingParams.greedy().replace(max_tokens=20)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = plain()
    prompts = [engine.info.tokenizer.encode(p) for p in PROMPTS]
    return prompts, run_with_flip(engine, prompts, GREEDY)


def test_tensor_parallel_speculation_gives_the_single_device_tokens(reference):
    prompts, want = reference
    engine = speculative(3, layout="tp:2")
    assert run_with_flip(engine, prompts, GREEDY) == want
    assert engine.stats().speculative.accepted > 0
    assert_pools_returned(engine)


def test_pipeline_speculation_and_flips_mid_run_keep_every_token(reference, tmp_path):
    prompts, want = reference
    model = untied_copy(tmp_path / "untied")  # a pipeline cannot split a tied head
    engine = speculative(2, model=model, layout="pp:5,3")
    assert run_with_flip(engine, prompts, GREEDY, flip_at=4, target="tp:2") == want
    assert engine.stats().layout == "tp:2"
    assert run_with_flip(engine, prompts, GREEDY, flip_at=3, target="pp:5,3") == want
    stats = engine.stats()
    assert stats.layout == "pp:5,3" and len(stats.flips) == 2
    assert stats.speculative.accepted > 0
    assert_pools_returned(engine)
