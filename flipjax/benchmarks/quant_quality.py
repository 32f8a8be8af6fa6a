"""The quality half of `python -m flipjax.bench quant`: what int8 weights and 8-bit KV pages
change in the bench model's outputs, against the unquantized model with float pages.

- `prompt_logits`: every prompt position's logits, the prompt written into KV pages of the
  variant's dtype and read back through the paged attention the engine runs;
- `kl`: the mean KL(reference || variant) of two such logit sets;
- `greedy_agreement`: how far two engines' free-running greedy runs of the same prompts agree;
- `lm_eval_loglikelihoods`: lm-eval's own harness scoring a local multiple-choice task through
  an engine's prompt logprobs (`EngineLM`; what lm-eval reads through the server, as
  `tests/serve/test_lm_eval.py` shows), so the deltas are the harness's loglikelihoods.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 16
# A local multiple-choice task: questions with a few choices each, no download.
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def prompt_logits(
    folder: str, dtype: str, quantization: str | None, kv_cache_dtype: str, prompts: list[list[int]]
) -> np.ndarray:
    """Each prompt's logits at every position, [P, T, vocab], from the model as a one-device
    stage runs it (the native kernels where they build), its K and V written into pages of
    `kv_cache_dtype` and attended to from there."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from flipjax.engine.loader import load
    from flipjax.model.config import FULL_ATTENTION
    from flipjax.model.dtypes import parse_dtype
    from flipjax.model.gated_deltanet import Qwen3NextGatedDeltaNet
    from flipjax.model.quantize import quantize_model
    from flipjax.model.qwen3_next import forward
    from flipjax.runtime.cache import init_cache_state, kv_page_dtype
    from flipjax.runtime.paged import PagedKV
    from kernels_pallas import dispatch, head_parallel

    model_dtype = parse_dtype(dtype)
    model = quantize_model(load(folder, model_dtype, None, quantization).model, quantization)
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    params = jax.device_put(params)
    tokens = jnp.asarray(prompts, jnp.int32)
    b, t = tokens.shape
    per_row = -(-t // PAGE)
    pools = init_cache_state(
        cfg, b * per_row, PAGE, 1, model_dtype, kv_page_dtype(kv_cache_dtype, model_dtype)
    )
    table = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
    kv = iter(pools.kv)
    cache = tuple(
        PagedKV(next(kv), table)
        if kind == FULL_ATTENTION
        else Qwen3NextGatedDeltaNet.empty_state(cfg, b, model_dtype)
        for kind in cfg.layer_types
    )
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    with (
        dispatch.kernels(dispatch.default_mode()),
        head_parallel.across(Mesh(np.array(jax.devices()[:1]), ("tp",))),
    ):
        logits, _ = jax.jit(forward, static_argnums=0)(graphdef, params, tokens, positions, cache)
    return np.asarray(logits, np.float64)


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def greedy_agreement(base: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """Two sets of greedy runs of the same prompts: the median index of each run's first
    differing token (its length where none differs), and the share of positions equal.

    After a first difference the two runs continue different texts, so the share counts the
    positions where they happen to meet again; one flipped near-tie early in a run costs most
    of that run."""
    firsts, equal, total = [], 0, 0
    for x, y in zip(base, other, strict=True):
        if len(x) != len(y):
            raise ValueError(f"greedy_agreement: runs of {len(x)} and {len(y)} tokens")
        differ = [i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t]
        firsts.append(differ[0] if differ else len(x))
        equal += len(x) - len(differ)
        total += len(x)
    return int(np.median(firsts)), equal / total


def held_out_windows(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the first window of each of the training corpus's
    held-out files long enough for one (text the trained default saw the like of, never
    these)."""
    from flipjax.train import corpus

    windows = []
    for doc in corpus.load().held_out:
        ids = tokenizer.encode(doc.text)
        if len(ids) >= length:
            windows.append(list(ids[:length]))
        if len(windows) == count:
            return windows
    raise SystemExit(f"the held-out files give only {len(windows)} prompts of {length} tokens")


def task_rows(vocab: int, count: int = 24, seed: int = 0) -> list[dict[str, Any]]:
    """Multiple-choice rows of random token ids spelled as words (the bench checkpoint has no
    tokenizer; `_encode` reads the words back as ids), four choices each."""
    rng = np.random.default_rng(seed)

    def words(n: int) -> str:
        return " ".join(str(int(i)) for i in rng.integers(0, vocab, n))

    return [
        {"question": words(24), "choices": [" " + words(4) for _ in range(4)], "answer": 0}
        for _ in range(count)
    ]


def lm_eval_loglikelihoods(engine: Any, rows: list[dict[str, Any]]) -> tuple[np.ndarray, float]:
    """lm-eval's loglikelihood of every (question, choice) of `rows`, [rows, choices], and its
    accuracy, through `engine`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as folder:
        write_task(Path(folder), "flipjax_quant_mc", rows)
        results = lm_eval.simple_evaluate(
            model=_engine_lm(engine),
            tasks=["flipjax_quant_mc"],
            task_manager=TaskManager(include_path=folder, include_defaults=False),
            log_samples=True,
        )
    samples = sorted(results["samples"]["flipjax_quant_mc"], key=lambda s: s["doc_id"])
    scores = np.array([[float(r[0][0]) for r in s["resps"]] for s in samples])
    return scores, float(results["results"]["flipjax_quant_mc"]["acc,none"])


def write_task(folder: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """lm-eval task `name` in `folder` (its `include_path`): `rows` as its local test split."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(TASK.format(name=name, data=data))


def _encode(text: str) -> list[int]:
    return [int(word) for word in text.split()]


def _engine_lm(engine: Any) -> Any:
    """An lm-eval model over `engine`: loglikelihoods from its prompt logprobs."""
    from lm_eval.api.model import LM

    from flipjax import SamplingParams

    class EngineLM(LM):
        def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
            pairs = [r.args for r in requests]
            ids = [(_encode(c), _encode(c + x)) for c, x in pairs]
            scored = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
            outs = engine.generate([full for _, full in ids], sampling=scored)
            answers = []
            for (context, _), out in zip(ids, outs, strict=True):
                tail = out.prompt_logprobs[len(context) :]
                greedy = all(e.top[0][0] == e.token_id for e in tail)
                answers.append((sum(e.logprob for e in tail), greedy))
            return answers

        def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
            raise NotImplementedError("the quant bench's task is multiple choice")

        def generate_until(self, requests: list[Any]) -> list[str]:
            raise NotImplementedError("the quant bench's task is multiple choice")

    return EngineLM()
