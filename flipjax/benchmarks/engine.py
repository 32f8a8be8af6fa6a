"""`python -m flipjax.bench engine`: flipjax against transformers on the same model and CPU.

Both run the same random-weight checkpoint in the same dtype (fp32 unless `--dtype`) on
128-token prompts, greedy, cold (flipjax's prefix cache is flushed before every run). For each
batch size: prefill rate = prompt tokens / time to the first token; decode rate = batch * 64 /
(time for 65 tokens - time for 1). As transformers' `generate` does, flipjax prefills the whole
batch before its first decode step (its prefill budget covers every prompt), so both decode
rates time 64 steps of the full batch. Two bounds on a decode step are measured in the same run: the
weight read (a matvec over the weight bytes: every weight is read once per step) and the
matmuls (the step's GEMM FLOPs at the rate of an [batch, 768] x [768, 32000] GEMM); each batch
reports the fraction of either bound flipjax reaches.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flipjax.benchmarks.machine import (
    copy_bandwidth_gbs,
    gemm_flops,
    matmul_tflops,
    matvec_seconds,
)
from flipjax.benchmarks.memory import PeakRSS

# The reference config of the engine benchmark (about 133M parameters).
REFERENCE_CONFIG = dict(
    vocab_size=32000,
    hidden_size=768,
    num_hidden_layers=12,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=6,
    linear_num_value_heads=12,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=2048,
    num_experts=0,
    mlp_only_layers=list(range(12)),
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


@dataclass
class Timing:
    prefill_tok_s: float
    decode_tok_s: float
    peak_mb: float


def measure(run: Callable[[int], None], batch: int, prompt_len: int, decode: int) -> Timing:
    """run(n) generates n tokens for the whole batch; best of two of each length."""
    with PeakRSS() as mem:
        t1 = min(timed(lambda: run(1)) for _ in range(2))
        tn = min(timed(lambda: run(decode + 1)) for _ in range(2))
    return Timing(batch * prompt_len / t1, batch * decode / (tn - t1), mem.peak_delta / 2**20)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench engine", description=__doc__)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="flipjax's prefill budget per step (default: every prompt of the "
        "largest batch; with less, a batch's first rows decode while its later "
        "prompts prefill, and the decode rate also times those steps)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="take each step's tokens in before the next, as in serve",
    )
    args = p.parse_args(argv)
    try:
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    except ImportError as e:
        raise SystemExit(f"bench engine needs the test extra (torch, transformers): {e}") from e
    import jax.numpy as jnp

    from flipjax import Engine, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**REFERENCE_CONFIG)).eval()
        hf = hf.to(getattr(torch, args.dtype))
        hf.save_pretrained(folder, safe_serialization=True)
        n_params = sum(p.numel() for p in hf.parameters())
        embedding = REFERENCE_CONFIG["vocab_size"] * REFERENCE_CONFIG["hidden_size"]
        engine = Engine.from_pretrained(
            folder,
            args.dtype,
            max_running_requests=max(batches),
            max_prefill_tokens=args.max_prefill_tokens or max(batches) * args.prompt_len,
            max_model_len=args.prompt_len + args.decode_tokens + 16,
            num_pages=max(batches) * ((args.prompt_len + args.decode_tokens) // 16 + 2),
            overlap=not args.disable_overlap_schedule,
        )
    t0 = time.perf_counter()
    engine.warmup()
    print(
        f"model: {n_params / 1e6:.0f}M parameters, {args.dtype}; flipjax warm-up compile "
        f"{time.perf_counter() - t0:.0f} s ({engine.stats().compiles} programs)"
    )

    dtype = jnp.dtype(args.dtype)
    weight_bytes = dtype.itemsize * n_params
    bw = copy_bandwidth_gbs()
    floor_s = matvec_seconds(weight_bytes, dtype=dtype)
    print(
        f"machine: copy {bw:.1f} GB/s, fp32 matmul {matmul_tflops() * 1e3:.0f} GFLOP/s, "
        f"matvec over {weight_bytes / 1e6:.0f} MB of weights {floor_s * 1e3:.1f} ms "
        f"-> batch-1 decode bound {1 / floor_s:.1f} tok/s"
    )
    # A decode step multiplies every weight but the embedding's (a lookup) once per row.
    step_flops = 2 * (n_params - embedding)

    header = (
        f"{'batch':>5} {'system':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MB':>8}"
    )
    print(header)
    for batch in batches:
        prompts = rng.integers(0, REFERENCE_CONFIG["vocab_size"], (batch, args.prompt_len))

        def run_hf(n: int, prompts: np.ndarray = prompts) -> None:
            with torch.no_grad():
                hf.generate(
                    torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )

        def run_fj(n: int, prompts: np.ndarray = prompts) -> None:
            # Cold every time, as transformers is: no run may reuse the last one's prefixes.
            engine.flush_prefix_cache()
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            engine.generate([list(map(int, p)) for p in prompts], sampling=params)

        fj = measure(run_fj, batch, args.prompt_len, args.decode_tokens)
        ref = measure(run_hf, batch, args.prompt_len, args.decode_tokens)
        for name, t in (("transformers", ref), ("flipjax", fj)):
            print(
                f"{batch:>5} {name:>12} {t.prefill_tok_s:>14.1f} {t.decode_tok_s:>13.1f} "
                f"{t.peak_mb:>8.0f}"
            )
        print(
            f"{batch:>5} {'ratio':>12} {fj.prefill_tok_s / ref.prefill_tok_s:>13.2f}x "
            f"{fj.decode_tok_s / ref.decode_tok_s:>12.2f}x"
        )
        flop_s = step_flops * batch / gemm_flops(batch, dtype=dtype)
        print(
            f"      flipjax decode reaches {fj.decode_tok_s * floor_s / batch:.0%} of the "
            f"weight-read bound ({batch / floor_s:.0f} tok/s) and "
            f"{fj.decode_tok_s * flop_s / batch:.0%} of the matmul bound "
            f"({batch / flop_s:.0f} tok/s)"
        )
    engine.check()
