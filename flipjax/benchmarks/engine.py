"""`python -m flipjax.bench engine`: flipjax against transformers on the same model and CPU.

Both run the same random-weight checkpoint in the same dtype (fp32 unless `--dtype`) on
128-token prompts, greedy, cold (flipjax's prefix cache is flushed before every run). For each
batch size, both timed within one run of 65 tokens: prefill rate = prompt tokens / time to the
batch's first token; decode rate = batch * 64 / time from the first token to the last
(`flipjax.benchmarks.run_timing`). Each system's rates are its best of `--rounds` rounds (two),
a round running every system once in turn, so that a spell of a slower machine falls on
each system's runs alike. As transformers' `generate` does, flipjax
prefills the whole batch before its first decode step (its prefill budget covers every prompt),
so both decode rates time 64 steps of the full batch. Two bounds on a decode step are measured
in the same run: the weight read (a matvec over the weight bytes: every weight is read once
per step; measured again beside each batch's runs, as a shared machine's memory bandwidth
drifts by a third within a run) and the matmuls (the step's GEMM FLOPs at the rate of an
[batch, 768] x [768, 32000] GEMM, timed right after each of flipjax's runs:
`flipjax.benchmarks.matmul_bound`); each batch reports the fraction of the weight-read bound
every system reaches, and of the matmul bound flipjax reaches.

`--moe` runs the mixture-of-experts variant of the model (16 experts, top-2, and a gated shared
expert on every layer) instead of the dense one. A step then reads only the weights its tokens
route to, so the weight-read bound counts the active parameters: attention, GDN, the shared
expert, the router and the routed experts a batch touches (with uniform routing, a batch of b
touches 16 * (1 - (14/16)^b) experts per layer on average). `--peer llama.cpp` also runs
llama.cpp's own batched bench on the same checkpoint (`flipjax.benchmarks.llama_cpp`: built once
from source; where it cannot take the checkpoint it says why and the rest still runs).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from flipjax.benchmarks import step_profile
from flipjax.benchmarks.kernel_paths import kernel_paths
from flipjax.benchmarks.llama_cpp import Unavailable, prepare_llama_cpp
from flipjax.benchmarks.machine import copy_bandwidth_gbs, matmul_tflops, matvec_seconds
from flipjax.benchmarks.matmul_bound import Round, describe, timed_beside
from flipjax.benchmarks.run_timing import Timing, TokenTimes, interleaved, measure, output_times

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
# Its mixture-of-experts variant: every layer's MLP is 16 experts (top-2) and a shared expert.
# The vocabulary is the size of the tokenizer llama.cpp's converter is given (see `llama_cpp`),
# so that all three systems run one checkpoint.
MOE_CONFIG = dict(
    REFERENCE_CONFIG,
    vocab_size=32256,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    mlp_only_layers=[],
    decoder_sparse_step=1,
)
PEERS = ("transformers", "llama.cpp")


def active_parameters(config: dict, n_params: int, batch: int, *, per_token: bool) -> float:
    """The parameters a decode step of `batch` rows multiplies, the embedding (a lookup) aside:
    all of them for a dense model; for a mixture of experts, the routed experts' share. With
    `per_token`, the ones one token's row uses (the FLOPs of the step are 2 x this x batch);
    otherwise the ones the whole step reads, its tokens touching 1 - (1 - k/E)^batch of each
    layer's experts under uniform routing."""
    dense = n_params - config["vocab_size"] * config["hidden_size"]
    experts, k = config["num_experts"], config.get("num_experts_per_tok", 0)
    if not experts:
        return dense
    per_expert = 3 * config["hidden_size"] * config["moe_intermediate_size"]
    all_experts = config["num_hidden_layers"] * experts * per_expert
    share = k / experts if per_token else 1 - (1 - k / experts) ** batch
    return dense - all_experts + share * all_experts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench engine", description=__doc__)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--moe", action="store_true", help="the mixture-of-experts variant")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds per batch size, each running every system once in turn; each system's "
        "rates are its best round's",
    )
    p.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="flipjax's weights quantized at load, and llama.cpp's converted to its int8 "
        "(Q8_0); transformers stays unquantized",
    )
    p.add_argument(
        "--peer",
        action="append",
        choices=PEERS,
        default=None,
        help="peers to run beside flipjax (repeatable; default transformers)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="flipjax's prefill budget per step (default: every prompt of the "
        "largest batch; with less, a batch's first rows decode while its later "
        "prompts prefill, and the decode rate also times those steps)",
    )
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="the KV pool's pages (default: just what the largest batch needs); a decode "
        "step should cost the same with a large pool as with a small one",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each batch's rounds, trace one more flipjax run and print where a decode "
        "step's time goes (`flipjax.benchmarks.step_profile`)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="take each step's tokens in before the next, as in serve",
    )
    args = p.parse_args(argv)
    peers = args.peer or ["transformers"]
    try:
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    except ImportError as e:
        raise SystemExit(f"bench engine needs the test extra (torch, transformers): {e}") from e
    with tempfile.TemporaryDirectory() as folder:
        config = MOE_CONFIG if args.moe else REFERENCE_CONFIG
        torch.manual_seed(0)
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**config)).eval()
        hf = hf.to(getattr(torch, args.dtype))
        hf.save_pretrained(folder, safe_serialization=True)
        _run(args, peers, config, hf, Path(folder))


def _run(args: argparse.Namespace, peers: list[str], config: dict, hf, folder: Path) -> None:
    import torch

    from flipjax import Engine, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rng = np.random.default_rng(0)
    n_params = sum(p.numel() for p in hf.parameters())
    engine = Engine.from_pretrained(
        str(folder),
        dtype=args.dtype,
        quantization=args.quantization,
        max_running_requests=max(batches),
        max_prefill_tokens=args.max_prefill_tokens or max(batches) * args.prompt_len,
        max_model_len=args.prompt_len + args.decode_tokens + 16,
        num_pages=args.num_pages
        or max(batches) * ((args.prompt_len + args.decode_tokens) // 16 + 2),
        overlap=not args.disable_overlap_schedule,
    )
    t0 = time.perf_counter()
    engine.warmup()
    kind = "mixture of experts" if config["num_experts"] else "dense"
    print(
        f"model: {n_params / 1e6:.0f}M parameters ({kind}), {args.dtype}; flipjax warm-up "
        f"compile {time.perf_counter() - t0:.0f} s ({engine.stats().compiles} programs)"
    )
    print(kernel_paths(batches, jnp.dtype(args.dtype), bool(config["num_experts"])))
    llama = None
    if "llama.cpp" in peers:
        try:
            threads = os.cpu_count() or 1
            llama = prepare_llama_cpp(folder, threads, args.dtype, args.quantization)
            print(f"llama.cpp: {llama.build}")
        except Unavailable as e:
            print(f"llama.cpp: {e}")

    dtype = jnp.dtype(args.dtype)
    dense_bytes = dtype.itemsize * active_parameters(config, n_params, 1, per_token=False)
    read_s = matvec_seconds(int(dense_bytes), dtype=dtype) / dense_bytes  # per byte
    print(
        f"machine: copy {copy_bandwidth_gbs():.1f} GB/s, fp32 matmul "
        f"{matmul_tflops() * 1e3:.0f} GFLOP/s, weights read by a matvec at "
        f"{1 / read_s / 1e9:.1f} GB/s"
    )
    header = (
        f"{'batch':>5} {'system':>15} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MB':>8}"
    )
    print(header)
    for batch in batches:
        prompts = rng.integers(0, config["vocab_size"], (batch, args.prompt_len))

        def run_hf(n: int, prompts: np.ndarray = prompts) -> tuple[float, float]:
            times = TokenTimes()
            start = time.perf_counter()
            with torch.no_grad():
                hf.generate(
                    torch.tensor(prompts),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    streamer=times,
                )
            return times.split(start, n)

        def run_fj(n: int, prompts: np.ndarray = prompts) -> tuple[float, float]:
            # Cold every time, as transformers is: no run may reuse the last one's prefixes.
            engine.flush_prefix_cache()
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            return output_times(
                engine.generate([list(map(int, p)) for p in prompts], sampling=params)
            )

        def run_llama(batch: int = batch) -> Timing | None:
            try:
                rate = llama.rates([batch], args.prompt_len, args.decode_tokens)[batch]
            except (Unavailable, KeyError) as e:
                print(f"llama.cpp: batch {batch}: {e!r}")
                return None
            return Timing(rate.prefill_tok_s, rate.decode_tok_s, float("nan"))

        systems: dict[str, Callable[[], Timing | None]] = {}
        if llama is not None:
            systems["llama.cpp"] = run_llama
        if "transformers" in peers:
            systems["transformers"] = functools.partial(
                measure, run_hf, batch, args.prompt_len, args.decode_tokens, runs=1
            )
        fj_rounds: list[Round] = []
        systems["flipjax"] = timed_beside(
            functools.partial(measure, run_fj, batch, args.prompt_len, args.decode_tokens, runs=1),
            batch,
            dtype,
            fj_rounds,
        )
        rows = list(interleaved(systems, args.rounds).items())  # flipjax's last
        fj = rows[-1][1]
        for name, t in rows:
            print(
                f"{batch:>5} {name:>15} {t.prefill_tok_s:>14.1f} {t.decode_tok_s:>13.1f} "
                f"{t.peak_mb:>8.0f}"
            )
        for name, t in rows[:-1]:
            print(
                f"{batch:>5} {'vs ' + name:>15} {fj.prefill_tok_s / t.prefill_tok_s:>13.2f}x "
                f"{fj.decode_tok_s / t.decode_tok_s:>12.2f}x"
            )
        if args.profile:  # quantized, without the bound: its GEMM prices weights in --dtype
            run = functools.partial(run_fj, args.decode_tokens + 1)
            lines = step_profile.report(run, batch, None if args.quantization else dtype)
            print("\n".join("      " + line for line in lines))
        if args.quantization is not None:
            continue  # the bounds below price weights in --dtype
        read_s = matvec_seconds(int(dense_bytes), dtype=dtype) / dense_bytes
        read_bound = batch / (
            read_s * dtype.itemsize * active_parameters(config, n_params, batch, per_token=False)
        )
        print(
            f"      decode against the weight-read bound ({read_bound:.0f} tok/s, read at "
            f"{1 / read_s / 1e9:.1f} GB/s after these runs): "
            + ", ".join(f"{name} {t.decode_tok_s / read_bound:.0%}" for name, t in rows)
        )
        flops = 2 * batch * active_parameters(config, n_params, batch, per_token=True)
        print(f"      {describe(fj_rounds, batch, flops)}")
    engine.check()
