"""The public Engine API on the embedded tiny model: batching, strings, refusals."""

from __future__ import annotations

import chex
import numpy as np
import pytest

from flipjax import Engine, Output
from tests.support.internals import prompt_logits


@pytest.fixture(scope="module")
def tiny():
    return Engine.from_pretrained("tiny")


def test_tiny_is_deterministic(tiny):
    again = Engine.from_pretrained("tiny")
    np.testing.assert_array_equal(prompt_logits(again, [1, 2, 3]), prompt_logits(tiny, [1, 2, 3]))


def test_prompt_logits_shape(tiny):
    logits = prompt_logits(tiny, [10, 20, 30, 40])
    chex.assert_shape(logits, (4, tiny.info.model.vocab_size))
    assert np.isfinite(logits).all()


def test_batched_generation_equals_one_by_one(tiny):
    prompts = ["The quick brown fox", "hi", [7] * 40, "é ü 漢字"]
    together = tiny.generate(prompts, max_new_tokens=10)
    alone = [tiny.generate([p], max_new_tokens=10)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(isinstance(o, Output) and len(o.token_ids) == 10 for o in together)


def test_generation_continues_the_prompt_logits(tiny):
    """The first generated token is the argmax of the last prompt logit row."""
    prompt = [72, 101, 108, 108, 111]
    out = tiny.generate([prompt], max_new_tokens=3)[0]
    assert out.prompt_token_ids == prompt
    assert out.token_ids[0] == int(np.argmax(prompt_logits(tiny, prompt)[-1]))
    # and the second is the argmax after appending the first
    assert out.token_ids[1] == int(np.argmax(prompt_logits(tiny, prompt + out.token_ids[:1])[-1]))


def test_text_is_decoded(tiny):
    out = tiny.generate(["abc"], max_new_tokens=4)[0]
    assert out.text == tiny.info.tokenizer.decode(out.token_ids)
    assert out.prompt_token_ids == list(b"abc")


@pytest.mark.parametrize(
    "prompt,field",
    [
        ([], "prompt: is empty"),
        ("", "prompt: is empty"),
        ([1, 320], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
    ],
)
def test_bad_prompts_are_refused(tiny, prompt, field):
    with pytest.raises(ValueError, match=field):
        tiny.generate([prompt])


def test_bad_lengths_are_refused(tiny):
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate(["x"], max_new_tokens=0)
    with pytest.raises(ValueError, match="exceed the context"):
        tiny.generate(["x"], max_new_tokens=tiny.info.model.max_position_embeddings)


def test_unknown_model_and_dtype_are_refused():
    with pytest.raises(ValueError, match="model"):
        Engine.from_pretrained("/nonexistent/folder")
    with pytest.raises(ValueError, match="dtype"):
        Engine.from_pretrained("tiny", dtype="float8")
