"""`python -m kernels_pallas.check`: every kernel against its reference on this machine.

For each kernel: compile, run on realistic shapes, report the max error against the pure-JAX
reference, time kernel and reference, and print achieved GB/s (and TFLOP/s where the kernel
does matmul work) beside a device copy bandwidth measured in the same run. One summary line per
kernel. On a GPU the kernels are compiled Pallas (`--shapes full` by default, decode 32 x 4096,
GQA 16/2, head_dim 128 and 256, bf16; a 512-token prefill chunk; GDN at 8k tokens); elsewhere
they run in interpret mode on small shapes, which proves the script, not the speed.

Like flipjax's CLI modules this is an entry point, so it may use flipjax (the timing helpers of
`flipjax.benchmarks.machine`); the kernel modules stay free of flipjax imports.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.benchmarks.machine import best_of, copy_bandwidth_gbs
from kernels_pallas.gdn import reference as gdn
from kernels_pallas.gdn.pallas_kernel import delta_rule_kernel, gated_delta_rule_step
from kernels_pallas.paged_attention.pallas_kernel import ragged_paged_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference


@dataclass(frozen=True)
class Shapes:
    batch: int
    context: int
    heads: int
    kv_heads: int
    head_dims: tuple[int, ...]
    page_size: int
    chunk: int
    gdn_tokens: int
    gdn_heads: int
    gdn_dim: int


FULL = Shapes(32, 4096, 16, 2, (128, 256), 16, 512, 8192, 32, 128)
SMALL = Shapes(2, 64, 4, 2, (16,), 8, 16, 96, 2, 16)


def best_ms(fn: Callable[..., object], args: tuple[jax.Array, ...], repeats: int) -> float:
    """Fastest time of `fn(*args)` over `repeats` runs after a warm-up, in ms."""
    return best_of(functools.partial(fn, *args), repeats) * 1e3


def max_err(a: jax.Array, b: jax.Array, mask: np.ndarray | None = None) -> float:
    diff = np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))
    return float(diff[mask].max() if mask is not None else diff.max())


def report(
    name: str, err: float, kernel_ms: float, ref_ms: float, nbytes: float, flops: float, copy: float
) -> None:
    gbs = nbytes / kernel_ms / 1e6
    print(
        f"{name:<34} max_err {err:.2e}  kernel {kernel_ms:8.3f} ms  reference {ref_ms:8.3f} ms"
        f"  speedup {ref_ms / kernel_ms:5.2f}x  {gbs:8.1f} GB/s ({gbs / copy:5.1%} of copy)"
        f"  {flops / kernel_ms / 1e9:7.2f} TFLOP/s",
        flush=True,
    )


def paged_inputs(s: Shapes, head_dim: int, new: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """`batch` requests (1 for a prefill chunk) whose last `new` tokens end at `context`."""
    batch = s.batch if new == 1 else 1
    key = jax.random.split(jax.random.PRNGKey(seed), 3)
    per_req = s.context // s.page_size
    pages = batch * per_req
    shape = (pages, s.page_size, s.kv_heads, head_dim)
    k = jax.random.normal(key[0], shape, jnp.bfloat16)
    v = jax.random.normal(key[1], shape, jnp.bfloat16)
    q = jax.random.normal(key[2], (batch, new, s.heads, head_dim), jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(pages)
    table = jnp.asarray(perm.reshape(batch, per_req), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s.context - new, s.context, dtype=jnp.int32), (batch, new))
    return q, k, v, table, pos


def check_paged(s: Shapes, interpret: bool, repeats: int, copy: float) -> None:
    for head_dim in s.head_dims:
        for new, label in ((1, "decode"), (s.chunk, "prefill")):
            q, k, v, table, pos = paged_inputs(s, head_dim, new)
            b = q.shape[0]
            rows = new * (s.heads // s.kv_heads)
            split = 1 if interpret else max(1, 128 // (b * s.kv_heads * -(-rows // 64)))
            kernel = jax.jit(
                lambda *a, sp=split, r=rows: ragged_paged_attention(
                    *a, block_rows=16 if r <= 16 else 64, kv_splits=sp, interpret=interpret
                )
            )
            reference = jax.jit(paged_attention_reference)
            args = (q, k, v, table, pos)
            err = max_err(kernel(*args), reference(*args))
            kv_bytes = 2 * b * s.context * s.kv_heads * head_dim * 2
            flops = 4 * b * new * s.context * s.heads * head_dim
            report(
                f"paged_attention {label} d{head_dim} b{b}x{new}",
                err,
                best_ms(kernel, args, repeats),
                best_ms(reference, args, repeats),
                kv_bytes + 2 * q.size * 2,
                flops,
                copy,
            )


def check_gdn(s: Shapes, interpret: bool, repeats: int, copy: float) -> None:
    key = jax.random.split(jax.random.PRNGKey(1), 6)
    h, d, t = s.gdn_heads, s.gdn_dim, s.gdn_tokens
    q = jax.random.normal(key[0], (1, t, h, d), jnp.float32)
    k = jax.random.normal(key[1], (1, t, h, d), jnp.float32)
    v = jax.random.normal(key[2], (1, t, h, d), jnp.float32)
    g = -jax.random.uniform(key[3], (1, t, h), jnp.float32)
    beta = jax.random.uniform(key[4], (1, t, h), jnp.float32)
    state = jnp.zeros((1, h, d, d), jnp.float32)
    valid = jnp.ones((1, t), bool)
    kernel = jax.jit(lambda *a: delta_rule_kernel(*a, interpret=interpret))
    reference = jax.jit(gdn.delta_rule_chunked)
    args = (q, k, v, g, beta, state, valid)
    (ko, ks), (ro, rs) = kernel(*args), reference(*args)
    err = max(max_err(ko, ro), max_err(ks, rs))
    c = 64
    flops = t * h * (4 * c * d + 8 * d * d)  # intra-chunk attention plus state in/out, per token
    report(
        f"gdn chunk t{t} h{h} d{d}",
        err,
        best_ms(kernel, args, repeats),
        best_ms(reference, args, repeats),
        4 * (4 * t * h * d),
        flops,
        copy,
    )

    b = s.batch
    step_args = tuple(a[:, 0] for a in (q, k, v, g, beta))
    states = jnp.ones((b, h, d, d), jnp.float32) * 0.01
    step_args = tuple(jnp.broadcast_to(a, (b, *a.shape[1:])) for a in step_args) + (states,)
    kernel_step = jax.jit(lambda *a: gated_delta_rule_step(*a, interpret=interpret))
    reference_step = jax.jit(gdn.delta_rule_step)
    (ko, ks), (ro, rs) = kernel_step(*step_args), reference_step(*step_args)
    report(
        f"gdn decode step b{b} h{h} d{d}",
        max(max_err(ko, ro), max_err(ks, rs)),
        best_ms(kernel_step, step_args, repeats),
        best_ms(reference_step, step_args, repeats),
        2 * states.size * 4,
        4 * b * h * d * d,
        copy,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels_pallas.check")
    parser.add_argument(
        "--shapes",
        choices=("full", "small"),
        default=None,
        help="default: full on a GPU, small elsewhere",
    )
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shapes = FULL if (args.shapes or ("full" if on_gpu else "small")) == "full" else SMALL
    interpret = not on_gpu
    copy = copy_bandwidth_gbs(1 << 30 if on_gpu else 64 << 20)
    print(
        f"device {jax.devices()[0].device_kind}  kernels {'interpret' if interpret else 'pallas'}"
        f"  copy bandwidth {copy:.1f} GB/s",
        flush=True,
    )
    check_paged(shapes, interpret, args.repeats, copy)
    check_gdn(shapes, interpret, args.repeats, copy)


if __name__ == "__main__":
    main()
