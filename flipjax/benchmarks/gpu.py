"""`python -m flipjax.bench gpu`: the kernel path on an accelerator, in one short run.

1. `kernels_pallas.check`: every kernel against its reference, GB/s beside the copy bandwidth;
2. engine decode at batch 1, 8 and 64 in bf16 (128-token prompts, 32 greedy tokens): the Pallas
   kernels against the XLA reference path, in tok/s and as a ratio;
3. prefill of one 4096-token prompt, both paths;
4. with more than one device, a live flip from one device (`single`, i.e. tp:1) to a two-stage
   pipeline and back, with requests in flight.

Prints a table and writes every number to `--json`. Off a GPU it runs the same steps on the
tiny model with the kernels interpreted (`--small`, the default there), which proves the
script, not the speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.benchmarks.engine import REFERENCE_CONFIG
from flipjax.benchmarks.run_timing import measure, output_times, timed

# About 0.6B parameters: big enough that a decode step is not all launch overhead.
GPU_CONFIG = dict(
    REFERENCE_CONFIG,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    intermediate_size=5632,
)


@functools.cache
def _model(small: bool) -> tuple[Any, jnp.dtype]:
    """The one model every engine of the run is built over (engines copy what they place)."""
    from flipjax.model.config import ModelConfig
    from flipjax.model.qwen3_next import Qwen3NextForCausalLM
    from flipjax.model.tiny import tiny_model

    if small:
        return tiny_model(jnp.float32), jnp.float32
    cfg = ModelConfig.from_hf({**GPU_CONFIG, "model_type": "qwen3_next"})
    return Qwen3NextForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), jnp.bfloat16


def _engine(kernels: str, small: bool, batch: int, prompt_len: int, layout: str | None = None):
    from flipjax import Engine
    from flipjax.config.tree import FlipjaxConfig
    from flipjax.model.tokenizer import ByteTokenizer
    from kernels_pallas import dispatch

    model, dtype = _model(small)
    page = 16
    config = FlipjaxConfig.build(
        dtype=np.dtype(dtype).name,
        layout=layout,
        page_size=page,
        max_running_requests=batch,
        max_prefill_tokens=min(prompt_len, 2048),
        max_model_len=prompt_len + 64,
        num_pages=batch * (prompt_len // page + 6) + 8,
    )
    with dispatch.kernels(kernels):  # the runner records the mode it is built under
        return Engine(model, ByteTokenizer(), config, name="bench")


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, length))) for _ in range(n)]


def decode_and_prefill(
    modes: tuple[str, str], small: bool, batches: list[int], prompt_len: int, decode: int, long: int
) -> dict[str, Any]:
    from flipjax import SamplingParams

    out: dict[str, Any] = {"decode": [], "prefill": {}}
    for batch in batches:
        row: dict[str, Any] = {"batch": batch}
        for mode in modes:
            engine = _engine(mode, small, batch, prompt_len)
            prompts = _prompts(batch, prompt_len)

            def run(n: int, engine=engine, prompts=prompts) -> tuple[float, float]:
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                return output_times(engine.generate(prompts, sampling=params))

            row[mode] = measure(run, batch, prompt_len, decode).decode_tok_s
        out["decode"].append(row)
    for mode in modes:
        engine = _engine(mode, small, 1, long)
        (prompt,) = _prompts(1, long, seed=1)
        params = SamplingParams(temperature=0, max_tokens=1)
        prefill = functools.partial(engine.generate, [prompt], sampling=params)
        prefill()  # compiles
        seconds = min(timed(prefill) for _ in range(2))
        out["prefill"][mode] = long / seconds
    return out


def flip_round_trip(kernels: str, small: bool) -> list[dict[str, Any]]:
    """single -> two stages -> single with requests in flight; the flips' records."""
    from flipjax import SamplingParams

    engine = _engine(kernels, small, 4, 128, layout="single")
    layers = engine.info.model.num_hidden_layers
    pipeline = f"pp:{layers // 2},{layers - layers // 2}"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    records = []
    for target in (pipeline, "single"):
        for p in _prompts(4, 128, seed=len(records) + 2):
            engine.add_request(p, params)
        for _ in range(4):
            engine.step()
        engine.arm(target)
        record = engine.flip(target)
        records.append(
            {
                "direction": record.direction,
                "total_ms": record.total_ms,
                "moved_mib": record.total_bytes / 2**20,
            }
        )
        while engine.has_unfinished():
            engine.step()
    engine.check()
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench gpu", description=__doc__)
    p.add_argument(
        "--small",
        action="store_true",
        default=None,
        help="the tiny model, interpreted kernels (the default off a GPU)",
    )
    p.add_argument("--json", default="flipjax_gpu_bench.json", help="where the numbers go")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    small = (not on_gpu) if args.small is None else args.small
    kernels = "interpret" if small else "pallas"
    t0 = time.perf_counter()
    from kernels_pallas import check

    check.main(["--shapes", "small" if small else "full", "--repeats", "1" if small else "10"])
    batches = [1, 2] if small else [1, 8, 64]
    prompt_len, decode, long = (32, 4, 256) if small else (128, 32, 4096)
    results: dict[str, Any] = {
        "device": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "model": "tiny (fp32)" if small else "GPU_CONFIG (bf16)",
        "kernels": kernels,
        **decode_and_prefill((kernels, "reference"), small, batches, prompt_len, decode, long),
    }
    print(f"{'batch':>5} {kernels + ' tok/s':>16} {'reference tok/s':>16} {'ratio':>6}")
    for row in results["decode"]:
        print(
            f"{row['batch']:>5} {row[kernels]:>16.1f} {row['reference']:>16.1f} "
            f"{row[kernels] / row['reference']:>5.2f}x"
        )
    pre = results["prefill"]
    print(
        f"prefill of {long} tokens: {kernels} {pre[kernels]:.0f} tok/s, reference "
        f"{pre['reference']:.0f} tok/s ({pre[kernels] / pre['reference']:.2f}x)"
    )
    if len(jax.devices()) > 1:
        results["flips"] = flip_round_trip(kernels, small)
        for f in results["flips"]:
            print(f"flip {f['direction']}: {f['total_ms']:.1f} ms, {f['moved_mib']:.1f} MiB")
    results["seconds"] = time.perf_counter() - t0
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{results['seconds']:.0f} s; numbers in {args.json}")
