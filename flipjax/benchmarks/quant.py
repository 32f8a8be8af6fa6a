"""`python -m flipjax.bench quant`: int8 weights (`--quantization int8`) against the same
checkpoint unquantized, on the engine benchmark's 133M model, in one run.

Quality, against the unquantized engine in `--dtype` (bf16 by default):
- the prompt logits' largest absolute difference and the mean KL(unquantized || int8), over
  `--prompts` random prompts of `--prompt-len` tokens (1024 positions by default);
- greedy agreement: how many of `--agree-tokens` greedy tokens match before the first
  difference, and the share of positions equal, over the same prompts.

Speed: decode tok/s at each batch size, int8 against unquantized, each engine timed as
`bench engine` times it (best of two of 1 and of n+1 tokens).

The bench model's weights are random, so its logits are flat and a greedy choice is often
between near-equal logits: agreement here is a lower bound of a trained model's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from flipjax.benchmarks.engine import REFERENCE_CONFIG, measure


def prompt_logits(folder: str, dtype: str, quantization: str | None, prompts: list[list[int]]):
    """Each prompt's logits at every position, [P, T, vocab], from the model as a one-device
    stage runs it (the native kernels where they build)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from flipjax.engine.loader import load
    from flipjax.model.dtypes import parse_dtype
    from flipjax.model.quantize import quantize_model
    from flipjax.model.qwen3_next import forward, init_cache
    from kernels_pallas import dispatch, head_parallel

    model = quantize_model(load(folder, parse_dtype(dtype)).model, quantization)
    graphdef, params = nnx.split(model)
    params = jax.device_put(params)
    tokens = jnp.asarray(prompts, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    cache = init_cache(model.cfg, len(prompts), tokens.shape[1], parse_dtype(dtype))
    with (
        dispatch.kernels(dispatch.default_mode()),
        head_parallel.across(Mesh(np.array(jax.devices()[:1]), ("tp",))),
    ):
        logits, _ = jax.jit(forward, static_argnums=0)(graphdef, params, tokens, positions, cache)
    return np.asarray(logits, np.float64)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench quant", description=__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--agree-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    args = p.parse_args(argv)
    try:
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    except ImportError as e:
        raise SystemExit(f"bench quant needs the test extra (torch, transformers): {e}") from e
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**REFERENCE_CONFIG)).eval()
        hf.save_pretrained(folder, safe_serialization=True)
        del hf
        _run(args, Path(folder))


def _run(args: argparse.Namespace, folder: Path) -> None:
    from flipjax import Engine, SamplingParams

    batches = [int(b) for b in args.batch_sizes.split(",")]
    longest = max(args.prompt_len + args.agree_tokens, args.prompt_len + args.decode_tokens)
    options = dict(
        dtype=args.dtype,
        max_running_requests=max(max(batches), args.prompts),
        max_prefill_tokens=max(batches) * args.prompt_len,
        max_model_len=longest + 16,
        num_pages=max(max(batches), args.prompts) * (longest // 16 + 2),
    )
    engines = {
        args.dtype: Engine.from_pretrained(str(folder), **options),
        "int8": Engine.from_pretrained(str(folder), quantization="int8", **options),
    }
    for engine in engines.values():
        engine.warmup()
    weights = {k: sum(d.bytes["weights"] for d in e.memory().devices) for k, e in engines.items()}
    full, int8 = weights[args.dtype], weights["int8"]
    print(
        f"model: 133M parameters, activations {args.dtype}; weights {full / 2**20:.0f} MiB "
        f"unquantized, {int8 / 2**20:.0f} MiB int8 ({int8 / full:.2f}x)"
    )
    rng = np.random.default_rng(0)
    vocab = REFERENCE_CONFIG["vocab_size"]
    prompts = [list(map(int, rng.integers(0, vocab, args.prompt_len))) for _ in range(args.prompts)]
    base, quant = engines[args.dtype], engines["int8"]
    a = prompt_logits(str(folder), args.dtype, None, prompts)
    b = prompt_logits(str(folder), args.dtype, "int8", prompts)
    print(
        f"logits over {a.shape[0] * a.shape[1]} positions: max |diff| {np.abs(a - b).max():.4f} "
        f"(logits' own spread: std {a.std():.3f}), mean KL {_kl(a, b):.2e} nats"
    )
    greedy = SamplingParams(temperature=0, max_tokens=args.agree_tokens, ignore_eos=True)
    runs = [[o.token_ids for o in e.generate(prompts, sampling=greedy)] for e in (base, quant)]
    prefixes, equal = [], 0
    for x, y in zip(*runs, strict=True):
        differ = [i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t]
        prefixes.append(differ[0] if differ else len(x))
        equal += sum(s == t for s, t in zip(x, y, strict=True))
    print(
        f"greedy over {args.agree_tokens} tokens x {args.prompts} prompts: first difference at "
        f"{sorted(prefixes)} (median {int(np.median(prefixes))}); "
        f"{equal / (args.prompts * args.agree_tokens):.0%} of positions equal"
    )
    print(f"{'batch':>5} {'weights':>9} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for batch in batches:
        batch_prompts = [
            list(map(int, rng.integers(0, vocab, args.prompt_len))) for _ in range(batch)
        ]
        timings = {}
        for name, engine in engines.items():

            def run(n: int, engine=engine, prompts=batch_prompts) -> None:
                engine.flush_prefix_cache()
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                engine.generate(prompts, sampling=params)

            timings[name] = measure(run, batch, args.prompt_len, args.decode_tokens)
            t = timings[name]
            print(f"{batch:>5} {name:>9} {t.prefill_tok_s:>14.1f} {t.decode_tok_s:>13.1f}")
        a, b = timings[args.dtype], timings["int8"]
        label = "int8 vs " + args.dtype[:4]
        print(
            f"{batch:>5} {label:>9} {b.prefill_tok_s / a.prefill_tok_s:>13.2f}x "
            f"{b.decode_tok_s / a.decode_tok_s:>12.2f}x"
        )
