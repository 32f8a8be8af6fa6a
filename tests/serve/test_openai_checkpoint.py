"""The OpenAI surface over a transformers checkpoint with its own tokenizer and chat template:
`echo` logprobs (how lm-eval scores multiple-choice tasks) against transformers' log-softmax,
the template's `chat_template_kwargs`, the qwen3 reasoning parser, and grammars built from the
checkpoint's tokenizer."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.support.hf_oracle import make_checkpoint
from tests.support.servers import SMALL, start_server, stop_server
from tests.support.tokenizers import byte_tokenizer

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)
PROMPTS = [[5, 9, 33, 70, 2, 101], [44, 44, 12, 80, 7, 9, 120, 3, 55]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = make_checkpoint(str(folder), seed=3, vocab_size=256)
    byte_tokenizer(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return str(folder), model


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    folder, _ = checkpoint
    log_dir = tmp_path_factory.mktemp("hf-server")
    with open(log_dir / "log.txt", "w") as log:
        proc, base = start_server(
            log,
            "--model",
            folder,
            "--served-model-name",
            "hf",
            "--reasoning-parser",
            "qwen3",
            "--store-dir",
            "none",
            *SMALL,
        )
        try:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        finally:
            stop_server(proc)


def transformers_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    return [float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.parametrize("max_tokens", [0, 1])  # scoring only, and lm-eval's echo + 1 token
def test_echo_logprobs_match_transformers(client, checkpoint, max_tokens):
    _, model = checkpoint
    resp = client.completions.create(
        model="hf", prompt=PROMPTS, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, ids in zip(resp.choices, PROMPTS, strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = transformers_logprobs(model, ids)
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=2e-3)
        for token_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert max(top.values()) >= token_lp - 1e-6  # lm-eval's greedy check reads this
    assert resp.usage.prompt_tokens == sum(map(len, PROMPTS))


def test_chat_template_kwargs_reach_the_template_and_reasoning_is_split(client):
    messages = [{"role": "user", "content": "hi"}]
    thinking = (
        client.chat.completions.create(
            model="hf",
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        .choices[0]
        .message
    )
    plain = (
        client.chat.completions.create(
            model="hf",
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        .choices[0]
        .message
    )
    # The prompt opened <think> and the answer never closed it: all of it is reasoning.
    assert thinking.content is None and thinking.model_extra["reasoning_content"]
    assert plain.content and plain.model_extra["reasoning_content"] is None
    streamed = ""
    for chunk in client.chat.completions.create(
        model="hf",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    ):
        assert not chunk.choices[0].delta.content
        streamed += chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
    assert streamed.strip("\n") == thinking.model_extra["reasoning_content"]


def test_grammars_build_on_the_checkpoint_tokenizer(client):
    for seed in range(3):
        text = (
            client.completions.create(
                model="hf",
                prompt="x",
                max_tokens=20,
                temperature=1.0,
                seed=seed,
                extra_body={"guided_choice": ["alpha", "beta"]},
            )
            .choices[0]
            .text
        )
        assert text in ("alpha", "beta")
