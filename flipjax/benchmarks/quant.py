"""`python -m flipjax.bench quant`: int8 weights (`--quantization int8`), 8-bit KV pages
(`--kv-cache-dtype fp8_e4m3 | int8`) and both together, against the same checkpoint
unquantized with KV pages in `--dtype` (bf16 by default), on the engine benchmark's 133M model,
in one run.

Quality of each variant against the unquantized one:
- the prompt logits' largest absolute difference and the mean KL(unquantized || variant), over
  `--prompts` random prompts of `--prompt-len` tokens (1024 positions by default), the prompts'
  K and V read back from pages of the variant's dtype;
- top-1 agreement at those positions (the same prefix given to both: a greedy choice each);
- free-running greedy agreement: how many of `--agree-tokens` greedy tokens match before the
  first difference, and the share of positions equal, over the same prompts;
- the floor of each measure: the same rows for the unquantized model in the other float dtype
  (float32 against bf16, bf16 against float32), a change of rounding alone. In bf16 any
  perturbation, int8 rounding included, reorders bf16's own roundings, so against a bf16 base
  no variant's greedy agreement can be read above this row's; `--dtype float32` measures a
  variant in float32 arithmetic, where its own error is all that differs.
- lm-eval: its harness scoring a local multiple-choice task through each engine; the mean and
  largest |delta| of its loglikelihoods, and its accuracy.

Speed: decode tok/s at each batch size, int8 weights against unquantized, each engine timed as
`bench engine` times it (best of two of 1 and of n+1 tokens); and the KV variants' decode
tok/s at `--kv-context` tokens of context (prefilled once, then `--decode-tokens` steps timed).
Capacity: each KV dtype's page bytes, and pages and tokens per GiB.

The bench model's weights are random, so its logits are flat and a greedy choice is often
between near-equal logits: agreement here is a lower bound of a trained model's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from flipjax.benchmarks.engine import REFERENCE_CONFIG
from flipjax.benchmarks.quant_quality import (
    greedy_agreement,
    held_out_windows,
    kl,
    lm_eval_loglikelihoods,
    prompt_logits,
    task_rows,
)
from flipjax.benchmarks.run_timing import measure, output_times

VARIANTS: dict[str, dict[str, str]] = {
    "int8 weights": dict(quantization="int8"),
    "fp8 KV": dict(kv_cache_dtype="fp8_e4m3"),
    "int8 KV": dict(kv_cache_dtype="int8"),
    "int8 w + fp8 KV": dict(quantization="int8", kv_cache_dtype="fp8_e4m3"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench quant", description=__doc__)
    p.add_argument(
        "--model",
        help="a checkpoint folder or shipped name (flipjax-py: trained, so its greedy choices "
        "are not near-ties); its prompts are windows of the training corpus's held-out files. "
        "Default: the engine benchmark's random 133M model and random-token prompts",
    )
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--agree-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--kv-context", type=int, default=4096)
    p.add_argument("--kv-batch-sizes", default="1,8,32")
    args = p.parse_args(argv)
    if args.model is not None:
        from flipjax.model.shipped import resolve

        _run(args, Path(resolve(args.model)))
        return
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
    from flipjax import Engine

    batches = [int(b) for b in args.batch_sizes.split(",")]
    kv_batches = [int(b) for b in args.kv_batch_sizes.split(",")]
    longest = max(args.prompt_len + args.agree_tokens, args.kv_context + args.decode_tokens)
    rows = max(*batches, *kv_batches, args.prompts)
    options = dict(
        dtype=args.dtype,
        max_running_requests=rows,
        max_prefill_tokens=max(max(batches) * args.prompt_len, 2048),
        max_model_len=longest + 16,
        num_pages=rows * (longest // 16 + 2),
    )
    base_name = f"{args.dtype} (KV {args.dtype})"
    engines = {base_name: Engine.from_pretrained(str(folder), **options)}
    for name, variant in VARIANTS.items():
        engines[name] = Engine.from_pretrained(str(folder), **options, **variant)
    for engine in engines.values():
        engine.warmup()
    _sizes(engines, base_name)
    _load_peaks(args.dtype, folder, engines, base_name)
    _quality(args, folder, engines, base_name, options)
    _weight_speed(args, engines, base_name, batches)
    _kv_speed(args, engines, base_name, kv_batches)


def _sizes(engines: dict[str, Any], base_name: str) -> None:
    print(f"{'variant':>16} {'weights MiB':>11} {'page KiB':>9} {'pages/GiB':>10} {'tok/GiB':>9}")
    for name, engine in engines.items():
        (line,) = engine.memory().devices
        pages = engine.info.config.engine.num_pages
        page = line.bytes["kv_pages"] / pages
        print(
            f"{name:>16} {line.bytes['weights'] / 2**20:>11.0f} {page / 2**10:>9.1f} "
            f"{2**30 / page:>10.0f} {2**30 / page * engine.info.config.engine.page_size:>9.0f}"
        )


def _load_peaks(dtype: str, folder: Path, engines: dict[str, Any], base_name: str) -> None:
    """Each weight form's peak RSS while it loads (in a fresh process: the checkpoint read and
    quantized into host arrays; placing them is the engine's), against its weights' bytes."""
    code = "import sys; from flipjax.benchmarks import quant; print(quant.load_peak(*sys.argv[1:]))"
    for name, quantization in ((base_name, ""), ("int8 weights", "int8")):
        args = [str(folder), dtype, quantization]
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"load of {name}: the measuring process failed: {out.stderr[-2000:]}")
            continue
        peak = int(out.stdout.split()[-1])
        (line,) = engines[name].memory().devices
        weights = line.bytes["weights"]
        print(
            f"load of {name}: peak RSS {peak / 2**20:.0f} MiB above the process's start, "
            f"{peak / weights:.2f}x its weights ({weights / 2**20:.0f} MiB)"
        )


def load_peak(folder: str, dtype: str, quantization: str) -> int:
    """The peak RSS (bytes above the start) of loading `folder` into host arrays."""
    import jax

    from flipjax.benchmarks.memory import PeakRSS
    from flipjax.engine.loader import load
    from flipjax.model.dtypes import parse_dtype

    jax.devices()  # the runtime's own memory is not the load's
    with PeakRSS() as mem:
        load(folder, parse_dtype(dtype), None, quantization or None)
    return mem.peak_delta


def _quality(
    args: argparse.Namespace, folder: Path, engines: dict, base_name: str, options: dict
) -> None:
    from flipjax import Engine, SamplingParams

    vocab = engines[base_name].info.model.vocab_size
    if args.model is None:
        rng = np.random.default_rng(0)
        prompts = [
            list(map(int, rng.integers(0, vocab, args.prompt_len))) for _ in range(args.prompts)
        ]
    else:
        prompts = held_out_windows(engines[base_name].info.tokenizer, args.prompts, args.prompt_len)
    greedy = SamplingParams(temperature=0, max_tokens=args.agree_tokens, ignore_eos=True)
    rows = task_rows(vocab)
    other = "float32" if args.dtype == "bfloat16" else "bfloat16"
    floor = f"{other} (floor)"
    variants = {floor: dict(dtype=other), **VARIANTS}
    compared = dict(engines)
    compared[floor] = Engine.from_pretrained(str(folder), **dict(options, dtype=other))
    logits, runs, scores = {}, {}, {}
    for name, engine in compared.items():
        variant = variants.get(name, {})
        logits[name] = prompt_logits(
            str(folder),
            variant.get("dtype", args.dtype),
            variant.get("quantization"),
            variant.get("kv_cache_dtype", "auto"),
            prompts,
        )
        runs[name] = [o.token_ids for o in engine.generate(prompts, sampling=greedy)]
        scores[name] = lm_eval_loglikelihoods(engine, rows)
    a, (base_ll, base_acc) = logits[base_name], scores[base_name]
    print(
        f"quality against {base_name}: logits over {a.shape[0] * a.shape[1]} positions (their "
        f"std {a.std():.3f}); greedy over {args.agree_tokens} tokens x {args.prompts} prompts; "
        f"lm-eval loglikelihoods of {base_ll.size} choices (accuracy {base_acc:.2f} unquantized)"
    )
    print(
        f"{'variant':>16} {'max|dlogit|':>11} {'mean KL':>9} {'top-1 same':>10} "
        f"{'first diff (median)':>20} {'equal':>6} {'lm-eval mean|d|':>15} {'max|d|':>7} "
        f"{'acc':>5}"
    )
    for name in variants:
        b, (ll, acc) = logits[name], scores[name]
        first, same = greedy_agreement(runs[base_name], runs[name])
        delta, top1 = np.abs(ll - base_ll), np.mean(a.argmax(-1) == b.argmax(-1))
        print(
            f"{name:>16} {np.abs(a - b).max():>11.4f} {kl(a, b):>9.2e} {top1:>10.1%} "
            f"{first:>20} {same:>6.0%} "
            f"{delta.mean():>15.4f} {delta.max():>7.4f} {acc:>5.2f}"
        )


def _weight_speed(args: argparse.Namespace, engines: dict, base_name: str, batches: list) -> None:
    from flipjax import SamplingParams

    rng = np.random.default_rng(1)
    vocab = engines[base_name].info.model.vocab_size
    print(f"weights, {args.prompt_len}-token prompts")
    print(f"{'batch':>5} {'variant':>16} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for batch in batches:
        prompts = [list(map(int, rng.integers(0, vocab, args.prompt_len))) for _ in range(batch)]
        timings = {}
        for name in (base_name, "int8 weights"):
            engine = engines[name]

            def run(n: int, engine=engine, prompts=prompts) -> tuple[float, float]:
                engine.flush_prefix_cache()
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                return output_times(engine.generate(prompts, sampling=params))

            timings[name] = t = measure(run, batch, args.prompt_len, args.decode_tokens)
            print(f"{batch:>5} {name:>16} {t.prefill_tok_s:>14.1f} {t.decode_tok_s:>13.1f}")
        a, b = timings[base_name], timings["int8 weights"]
        print(
            f"{batch:>5} {'ratio':>16} "
            f"{b.prefill_tok_s / a.prefill_tok_s:>13.2f}x {b.decode_tok_s / a.decode_tok_s:>12.2f}x"
        )


def _kv_speed(args: argparse.Namespace, engines: dict, base_name: str, batches: list) -> None:
    rng = np.random.default_rng(2)
    vocab = engines[base_name].info.model.vocab_size
    names = (base_name, "fp8 KV", "int8 KV")
    print(f"KV pages, decode at {args.kv_context} tokens of context")
    print(f"{'batch':>5} " + " ".join(f"{n:>18}" for n in names) + "   fp8 / base  int8 / base")
    for batch in batches:
        prompts = [list(map(int, rng.integers(0, vocab, args.kv_context))) for _ in range(batch)]
        rates = [_decode_rate(engines[n], prompts, args.decode_tokens) for n in names]
        cells = " ".join(f"{r:>12.1f} tok/s" for r in rates)
        print(f"{batch:>5} {cells}   {rates[1] / rates[0]:>9.2f}x {rates[2] / rates[0]:>10.2f}x")


def _decode_rate(engine: Any, prompts: list[list[int]], steps: int) -> float:
    """Decode tok/s of `prompts` together once every one is prefilled (the better of two runs
    of `steps` tokens each; the prefill is not timed): decode rows over the steps' time."""
    from flipjax import SamplingParams

    best = 0.0
    for _ in range(2):
        engine.flush_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        while True:  # the prefill is over once a step decodes every row and prefills nothing
            engine.step()
            last = engine.last_step
            if last.prefill_tokens == 0 and last.decode_rows == len(prompts):
                break
        rows, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            rows += engine.last_step.decode_rows
        best = max(best, rows / (time.perf_counter() - t0))
    return best
