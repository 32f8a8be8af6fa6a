"""Speculative decoding is refused at start, naming the cause, where it cannot run: no MTP head,
K out of range, an 8-bit KV cache, a draft quantization it has none of, vLLM's and sglang's
settings disagreeing. sglang's flags and vLLM's JSON settle into the same settings."""

from __future__ import annotations

import json

import pytest

from flipjax import Engine
from flipjax.config.cli import parse
from flipjax.config.tree import FlipjaxConfig


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(speculative_algorithm="MTP", speculative_num_steps=5), r"\[1, 4\]"),
        (dict(speculative_algorithm="MTP", speculative_num_steps=0), r"\[1, 4\]"),
        (dict(speculative_num_steps=2), "without speculative_algorithm"),
        (dict(speculative_algorithm="EAGLE"), "'EAGLE' is not supported"),
        (dict(speculative_config="{"), "not JSON"),
        (dict(speculative_config="[1]"), "JSON object"),
        (dict(speculative_config='{"method": "ngram"}'), "method 'ngram'"),
        (dict(speculative_config='{"method": "mtp", "model": "x"}'), "'model' is not supported"),
        (
            dict(speculative_config='{"method": "mtp", "num_speculative_tokens": "2"}'),
            "must be an integer",
        ),
        (
            dict(
                speculative_config='{"method": "mtp", "num_speculative_tokens": 2}',
                speculative_num_steps=3,
            ),
            "disagrees",
        ),
        (dict(speculative_algorithm="MTP", kv_cache_dtype="fp8"), "kv-cache-dtype fp8_e4m3"),
        (
            dict(speculative_algorithm="MTP", speculative_draft_model_quantization="fp8"),
            "speculative_draft_model_quantization: 'fp8' is not supported",
        ),
        (dict(speculative_draft_model_quantization="int8"), "without speculative_algorithm"),
        (dict(speculative_config='{"method": "mtp", "quantization": "awq"}'), "quantization 'awq'"),
        (
            dict(
                speculative_config='{"method": "mtp", "quantization": "int8"}',
                speculative_draft_model_quantization="unquant",
            ),
            "'unquant' disagrees with speculative_config's 'int8'",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        FlipjaxConfig.build(**options)


def test_sglang_flags_and_vllm_json_are_the_same_settings():
    sglang = parse(["--speculative-algorithm", "MTP", "--speculative-num-steps", "2"], "x", "")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    vllm = parse(["--speculative-config", spec], "x", "")
    for config in (sglang, vllm):
        assert config.speculative.speculative_algorithm == "MTP"
        assert config.speculative.draft_tokens == 2
    default = FlipjaxConfig.build(speculative_algorithm="mtp")
    assert default.speculative.draft_tokens == 3
    # K more GDN slots per running request: a verify step keeps the state after each position.
    assert default.num_slots == default.engine.slots + 3 * default.engine.max_running_requests
    assert FlipjaxConfig().speculative.draft_tokens == 0


def test_the_draft_head_s_quantization_follows_the_model_s_unless_a_flag_or_the_json_says():
    sglang = ["--speculative-algorithm", "MTP", "--speculative-draft-model-quantization", "int8"]
    vllm = ["--speculative-config", json.dumps({"method": "mtp", "quantization": "int8"})]
    for args in (sglang, vllm):
        assert parse(args, "x", "").speculative.draft_quantization(None) == "int8"
    default = FlipjaxConfig.build(speculative_algorithm="MTP").speculative
    assert default.draft_quantization(None) is None
    assert default.draft_quantization("int8") == "int8"
    unquant = FlipjaxConfig.build(
        speculative_algorithm="MTP", speculative_draft_model_quantization="unquant"
    ).speculative
    assert unquant.draft_quantization("int8") is None


def test_a_model_without_an_mtp_head_is_refused_at_start():
    with pytest.raises(ValueError, match="has no MTP head"):
        Engine.from_pretrained("tiny", speculative_algorithm="MTP")
