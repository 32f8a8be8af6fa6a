"""`python -m flipjax.bench requests`: what two request features cost, each against its peer.

On the engine benchmark's reference model (133M parameters, fp32, random weights, vocabulary
32000) with a byte-level tokenizer:
- structured output: decode steps at batch 8 and 32 with every row under a grammar, against
  the same batch with none (the peer), and the host time to fill one row's bitmask, here and
  over a synthetic vocabulary the size of Qwen3's (151936 tokens);
- parallel choices: one request with `n` choices against `n` separate requests of the same
  prompt and seeds (the peer): prompt tokens computed, and the wall time to the last token.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.benchmarks.engine import REFERENCE_CONFIG
from flipjax.config.tree import FlipjaxConfig
from flipjax.engine.engine import Engine
from flipjax.model.config import ModelConfig
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.grammar import GrammarCompiler, xgrammar
from flipjax.runtime.sampler import bitmask_words
from flipjax.runtime.sampling import SamplingParams


def _engine(batch: int) -> Engine:
    cfg = ModelConfig.from_hf({**REFERENCE_CONFIG, "model_type": "qwen3_next"})
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    config = FlipjaxConfig.build(num_pages=4096, max_running_requests=batch, max_prefill_tokens=512)
    return Engine(model, ByteTokenizer(), config, name="reference")


def _drain(engine: Engine) -> tuple[float, int]:
    """Seconds until every request finished, and the prompt tokens computed meanwhile."""
    t0, prefilled = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        prefilled += engine.last_step.prefill_tokens
    return time.perf_counter() - t0, prefilled


def structured(engine: Engine, batch: int, tokens: int, rounds: int) -> None:
    grammars = GrammarCompiler(engine.info.tokenizer, engine.info.model.vocab_size)
    compiled = grammars.compile("regex", f"[a-z]{{{tokens + 8}}}")  # never done early
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True)

    def run(grammar: bool) -> float:
        for i in range(batch):
            constraint = grammars.constraint(compiled) if grammar else None
            engine.add_request([97 + i % 26] * 8, params, grammar=constraint)
        return _drain(engine)[0]

    run(False), run(True)  # compile the sampler's variants
    timings = {"no grammar": float("inf"), "every row": float("inf")}
    for _ in range(rounds):  # alternate, and keep each one's best: the machine is noisy
        for label, grammar in (("no grammar", False), ("every row", True)):
            timings[label] = min(timings[label], run(grammar) / tokens * 1e3)
    fill = grammars.constraint(compiled)
    t0 = time.perf_counter()
    for _ in range(200):
        fill.next_mask()
    fill_us = (time.perf_counter() - t0) / 200 * 1e6
    print(
        f"batch {batch:>2}: step {timings['no grammar']:6.1f} ms without grammar rows, "
        f"{timings['every row']:6.1f} ms with every row under a grammar "
        f"({timings['every row'] / timings['no grammar']:.2f}x); one row's mask fill "
        f"{fill_us:.0f} us"
    )


def fill_at_scale(vocab_size: int = 151936, steps: int = 64) -> None:
    """The host cost that grows with the vocabulary: compiling a JSON schema and filling one
    row's mask each step, over a synthetic vocabulary the size of Qwen3's."""
    xgr = xgrammar()
    rng = random.Random(0)
    vocab = [bytes([i]) for i in range(256)] + [
        bytes(rng.choices(range(32, 127), k=rng.randint(2, 8))) for _ in range(vocab_size - 256)
    ]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[0])
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(schema))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = np.zeros((1, bitmask_words(vocab_size)), np.int32)
    t0 = time.perf_counter()
    for token in b'{"name": "ab':
        matcher.fill_next_token_bitmask(mask)
        matcher.accept_token(token)
    for _ in range(steps):
        matcher.fill_next_token_bitmask(mask)
    fill_us = (time.perf_counter() - t0) / (steps + 12) * 1e6
    print(
        f"vocabulary {vocab_size}: a JSON schema compiles in {compile_s:.2f} s (once, off the "
        f"engine thread); one row's mask fill {fill_us:.0f} us per step"
    )


def choices(engine: Engine, n: int, prompt_len: int, tokens: int) -> None:
    prompt = [97 + (i * 7) % 26 for i in range(prompt_len)]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=tokens, ignore_eos=True)
    engine.generate([prompt[:32]], max_new_tokens=2)  # compile outside the timing
    engine.flush_prefix_cache()
    engine.add_request(prompt, params, n=n)
    forked_s, forked_tokens = _drain(engine)
    engine.flush_prefix_cache()
    for i in range(n):
        engine.add_request(prompt, params.replace(seed=5 + i))
    apart_s, apart_tokens = _drain(engine)
    print(
        f"n={n}, {prompt_len}-token prompt, {tokens} tokens each: one request computes "
        f"{forked_tokens} prompt tokens in {forked_s:.2f} s; {n} requests compute "
        f"{apart_tokens} in {apart_s:.2f} s ({apart_s / forked_s:.2f}x the time)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench requests", description=__doc__)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = _engine(max(batches))
    engine.warmup()
    for batch in batches:
        structured(engine, batch, args.tokens, args.rounds)
    fill_at_scale()
    choices(engine, 4, 512, args.tokens)
    engine.check()
