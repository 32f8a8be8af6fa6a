"""lm-eval's `local-completions` scores a multiple-choice task through the server (tokenizing
with the server's `/tokenize`), and every loglikelihood it reads equals the offline engine's
prompt logprobs of the same tokens. The task is a local JSON file: nothing is downloaded."""

from __future__ import annotations

import lm_eval
import numpy as np
import pytest
from lm_eval.tasks import TaskManager

from flipjax import Engine, SamplingParams
from flipjax.benchmarks.quant_quality import write_task
from tests.support.servers import SMALL, start_server, stop_server

ROWS = [
    {"question": "Q: 2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 0},
    {"question": "Q: the sky is", "choices": [" blue", " green"], "answer": 0},
    {"question": "Q: cats say", "choices": [" meow", " woof", " moo"], "answer": 1},
]


@pytest.fixture()
def task_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_task(tmp_path, "flipjax_mc", ROWS)
    return tmp_path


def offline_loglikelihood(engine: Engine, context: str, continuation: str) -> tuple[float, bool]:
    ids = list((context + continuation).encode())
    scored = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    entries = engine.generate([ids], sampling=scored)[0].prompt_logprobs
    tail = entries[len(context.encode()) :]
    greedy = all(e.top[0][0] == e.token_id for e in tail)
    return sum(e.logprob for e in tail), greedy


def test_lm_eval_scores_a_multiple_choice_task(task_dir, tmp_path):
    with open(tmp_path / "log.txt", "w") as log:
        proc, base = start_server(log, "--model", "tiny", "--store-dir", "none", *SMALL)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": "tiny",
                "base_url": f"{base}/v1/completions",
                "tokenizer_backend": "remote",
                "num_concurrent": 2,
                "max_retries": 1,
            },
            tasks=["flipjax_mc"],
            # Only the local task: indexing lm-eval's thousands of its own takes about 10 s.
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            log_samples=True,
        )
    finally:
        stop_server(proc)
    engine = Engine.from_pretrained("tiny", max_running_requests=4, max_prefill_tokens=64)
    samples = results["samples"]["flipjax_mc"]
    assert len(samples) == len(ROWS)
    correct = []
    for sample in samples:
        row = sample["doc"]
        scores = []
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ll, greedy = resp[0]
            want, want_greedy = offline_loglikelihood(engine, context, continuation)
            assert ll == pytest.approx(want, abs=2e-3) and greedy == want_greedy
            scores.append(ll)
        correct.append(int(np.argmax(scores)) == row["answer"])
    assert results["results"]["flipjax_mc"]["acc,none"] == pytest.approx(np.mean(correct))
