"""`python -m flipjax.bench train`: a training step of `python -m flipjax.train`'s default model
against transformers' Qwen3NextForCausalLM with torch's AdamW on the same shape and batch, and
against the matmul bound (the step's matmul FLOPs at this machine's square-GEMM rate).

The peer has no MTP head, so flipjax is timed both without it (the like-for-like ratio) and with
it (what `python -m flipjax.train` runs).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flipjax.benchmarks.machine import matmul_tflops
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.train.optimizer import OptimizerConfig, make_optimizer
from flipjax.train.shape import default_config
from flipjax.train.step import Trainer, data_mesh


def _flipjax_seconds(tokens: np.ndarray, mtp: bool, steps: int) -> tuple[float, int]:
    """Best seconds per step after a compiling one, and the matmul parameters a token meets."""
    cfg = default_config(4096, 0)
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), mtp=mtp)
    graphdef, params = nnx.split(model, nnx.Param)
    trainer = Trainer(
        graphdef,
        make_optimizer(OptimizerConfig(steps=100)),
        data_mesh(jax.devices()[:1]),
        mtp_weight=0.3 if mtp else 0.0,
    )
    params = trainer.place(params)
    opt_state = trainer.init_optimizer(params)
    batch = trainer.batch(tokens)
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        params, opt_state, metrics = trainer.step(params, opt_state, batch)
        float(metrics.losses.total)
        times.append(time.perf_counter() - began)
    # The head is a matmul against the (tied) embedding: once for the model, once for MTP.
    matrices = sum(x.size for x in jax.tree.leaves(params) if x.ndim == 2)
    heads = 2 if mtp else 1
    return min(times[1:]), matrices - cfg.vocab_size * cfg.hidden_size * (1 - heads)


def _transformers_seconds(tokens: np.ndarray, steps: int) -> float:
    import torch
    from transformers import Qwen3NextConfig
    from transformers import Qwen3NextForCausalLM as HFModel

    cfg = default_config(4096, 0).to_dict()
    for name in ("mtp_num_hidden_layers", "eos_token_id"):
        cfg.pop(name)
    torch.manual_seed(0)
    model = HFModel(Qwen3NextConfig(**cfg)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batch = torch.tensor(tokens, dtype=torch.long)
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - began)
    return min(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flipjax.bench train")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    tokens = np.random.default_rng(0).integers(0, 4096, (args.batch, args.seq_len))
    count = args.batch * args.seq_len
    peer = _transformers_seconds(tokens, args.steps)
    plain, plain_matrices = _flipjax_seconds(tokens, mtp=False, steps=args.steps)
    with_head, head_matrices = _flipjax_seconds(tokens, mtp=True, steps=args.steps)
    rate = matmul_tflops() * 1e12
    print(f"training step, {args.batch} x {args.seq_len} tokens, default model (fp32, 1 device)")
    print(f"  transformers + torch AdamW     {count / peer:8.0f} tok/s")
    for name, seconds, matrices in (
        ("flipjax, next-token loss", plain, plain_matrices),
        ("flipjax, with the MTP head", with_head, head_matrices),
    ):
        bound = 6 * matrices * count / rate
        print(
            f"  {name:<30} {count / seconds:8.0f} tok/s  {peer / seconds:5.2f}x transformers  "
            f"{bound / seconds:5.1%} of the matmul bound"
        )
    print(f"  (matmul bound: 6 x matrix parameters x tokens at {rate / 1e9:.0f} GFLOP/s)")
