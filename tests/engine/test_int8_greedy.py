"""Int8 weights keep the trained shipped model's greedy text. In float32 arithmetic the int8
engine's free-running greedy tokens follow the float32 engine's on held-out prompts: the issue's
agreement goal (95% of positions), measured where the weights' rounding is the only difference.
In bf16 arithmetic bf16's own rounding sets a lower floor for every variant (`bench quant`
prints it beside them)."""

from __future__ import annotations

import pytest

from flipjax import Engine, SamplingParams
from flipjax.benchmarks.quant_quality import greedy_agreement, held_out_windows

PROMPTS, PROMPT_LEN, TOKENS = 4, 96, 128
OPTIONS = dict(
    dtype="float32",
    max_running_requests=PROMPTS,
    max_model_len=PROMPT_LEN + TOKENS + 16,
    num_pages=PROMPTS * ((PROMPT_LEN + TOKENS) // 16 + 2),
)
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


def _runs(quantization: str | None) -> list[list[int]]:
    engine = Engine.from_pretrained("flipjax-py", quantization=quantization, **OPTIONS)
    prompts = held_out_windows(engine.info.tokenizer, PROMPTS, PROMPT_LEN)
    return [o.token_ids for o in engine.generate(prompts, sampling=GREEDY)]


def test_int8_weights_keep_the_trained_models_greedy_tokens_in_float32():
    first, same = greedy_agreement(_runs(None), _runs("int8"))
    assert same >= 0.95, f"equal positions {same:.0%}, first differences at median {first}"


def test_agreement_counts_the_first_difference_and_the_equal_positions():
    base = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert greedy_agreement(base, base) == (4, 1.0)
    other = [[1, 2, 0, 4], [0, 6, 7, 8], [9, 9, 9, 9]]
    assert greedy_agreement(base, other) == (2, 10 / 12)
    with pytest.raises(ValueError, match="runs of 4 and 3 tokens"):
        greedy_agreement(base, [[1, 2, 3], [5, 6, 7, 8], [9, 9, 9, 9]])
