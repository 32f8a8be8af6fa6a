"""The draft head's weights in int8 (`--speculative-draft-model-quantization`, sglang's flag):
its projections and its copy of the lm head, the largest weight a draft reads and read K times
a step. Drafts only propose, so the tokens stay the model's own; what it costs is acceptance,
held here near the float head's. By default the head follows the model's quantization."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flipjax import Engine
from tests.support.internals import parts, replace_draft_weight
from tests.support.speculation import PROMPTS, plain, speculative, untied_copy

TOKENS = 32


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in plain(overlap=False).generate(PROMPTS, max_new_tokens=TOKENS)]


def _weights(engine: Engine) -> tuple[dict[str, np.dtype], int]:
    """The drafter's weights (dtype by path) and their bytes."""
    weights, _kv = parts(engine).stepper.speculation.drafter.held()
    leaves = jax.tree_util.tree_leaves_with_path(weights)
    dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in leaves}
    return dtypes, sum(leaf.nbytes for _, leaf in leaves)


def _mean_accept_length(engine: Engine) -> float:
    return engine.stats().speculative.mean_accept_length


@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_draft_head_keeps_the_tokens_and_most_of_the_acceptance(expected, tied, tmp_path):
    model = {} if tied else {"model": untied_copy(tmp_path / "untied")}
    ways = {
        q: speculative(3, speculative_draft_model_quantization=q, **model)
        for q in ("unquant", "int8")
    }
    for engine in ways.values():
        assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=TOKENS)] == expected
    floats, int8 = (_mean_accept_length(ways[q]) for q in ("unquant", "int8"))
    assert int8 >= 0.9 * floats and int8 > 1.5, (floats, int8)
    (float_dtypes, float_bytes), (dtypes, nbytes) = (
        _weights(ways["unquant"]),
        _weights(ways["int8"]),
    )
    assert all(d == np.float32 for d in float_dtypes.values())
    assert not any("lm_int8" in p for p in float_dtypes)
    quantized = [p for p, d in dtypes.items() if d == np.int8]
    assert any("q_proj" in p for p in quantized) and any("fc" in p for p in quantized)
    assert any("lm_int8" in p for p in quantized), "the lm head a draft reads is not int8"
    assert not any("'head'" in p for p in dtypes), "an untied float lm head is still held"
    drafter = parts(ways["int8"]).stepper.speculation.drafter
    assert drafter.bytes[0] == nbytes  # what the pools were sized with is what it holds
    assert nbytes < 0.8 * float_bytes  # the float embedding it looks drafts up in stays


def test_the_draft_head_follows_the_model_s_quantization_unless_told(expected):
    model_int8 = speculative(3, quantization="int8")
    dtypes, _ = _weights(model_int8)
    assert dtypes["['mtp']['layers'][0]['mlp']['down_proj']['kernel'].value"] == np.int8
    assert dtypes["['lm_int8']['q']"] == np.int8
    unquant = speculative(3, quantization="int8", speculative_draft_model_quantization="unquant")
    dtypes, _ = _weights(unquant)
    assert dtypes["['mtp']['layers'][0]['mlp']['down_proj']['kernel'].value"] == np.float32
    assert not any("lm_int8" in p for p in dtypes)
    dtypes, _ = _weights(speculative(3))
    assert all(d == np.float32 for d in dtypes.values())


def test_drafts_come_from_the_int8_lm_head(expected):
    """With its int8 lm head zeroed, the head drafts nothing the model agrees with, and the
    tokens are still the model's own."""
    engine = speculative(3, speculative_draft_model_quantization="int8")
    weights, _ = parts(engine).stepper.speculation.drafter.held()
    zeros = np.zeros(weights["lm_int8"]["q"].shape, np.int8)
    replace_draft_weight(engine, "['lm_int8']['q']", zeros)
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=TOKENS)] == expected
    assert _mean_accept_length(engine) < 1.1
