"""`python -m flipjax.bench matmul`: the native small-batch matmul against XLA's dot.

For every distinct `[in, out]` weight of the engine benchmark's model and each row count, both
run `x [rows, in] @ w [in, out]` (w in fp32, or bf16 with `--dtype bfloat16`, accumulated in
fp32 as `Linear` runs it) over copies of the weight spanning twice this CPU's last-level cache,
so that none stays in cache between calls (as in a decode step, which reads each weight once).
Reports each time, the ratio and the weight bytes per second of either, and marks the row
counts `dispatch.matmul` hands to the native kernel (this machine's calibration,
`kernels_pallas/matmul/calibration.py`, which times the same two products).

`--ragged` measures the experts' grouped matmul instead: the native kernel against XLA's
`ragged_dot`, over the `--moe` engine benchmark's expert weights, for as many rows (token-expert
assignments) as decode at batch 1, 8 and 32 and a 128-token prefill at batch 1 and 32 make, with
the rows spread over the experts as uniform routing spreads them.

`--strides` runs the native kernel on each weight beside a peer a cache line wider, to show
what the weight's row stride costs it on this CPU (`matmul_strides.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.benchmarks import matmul_strides as strides
from flipjax.benchmarks.engine import MOE_CONFIG, REFERENCE_CONFIG
from flipjax.benchmarks.kernel_paths import native_matmul_picked
from kernels_pallas import native
from kernels_pallas.cpu_caches import uncached_copies
from kernels_pallas.matmul import native_binding as dense_native
from kernels_pallas.matmul.xla_form import xla_matmul
from kernels_pallas.ragged_matmul import native_binding as ragged_native


def weight_shapes(cfg: dict) -> list[tuple[int, int]]:
    """The distinct [in, out] shapes of the model's linear layers."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    shapes = {
        (h, cfg["vocab_size"]),  # lm head
        (h, cfg["intermediate_size"]),
        (cfg["intermediate_size"], h),  # MLP
        (h, 2 * hk * dk + 2 * hv * dv),
        (h, 2 * hv),
        (hv * dv, h),  # GDN in and out
        (h, 2 * cfg["num_attention_heads"] * d),
        (h, cfg["num_key_value_heads"] * d),  # q, k/v
    }
    return sorted(shapes, key=lambda s: -s[0] * s[1])


def per_call_seconds(
    product: Callable[[jax.Array, jax.Array], jax.Array],
    x: jax.Array,
    weights: list[jax.Array],
    repeats: int,
) -> float:
    """Median over `repeats` passes of `product(x, w)` over every copy `w`, per call."""
    jax.block_until_ready([product(x, w) for w in weights])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready([product(x, w) for w in weights])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(weights)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench matmul", description=__doc__)
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--ragged", action="store_true", help="the experts' grouped matmul")
    p.add_argument("--strides", action="store_true", help="each weight beside one a line wider")
    args = p.parse_args(argv)
    if not native.available():
        raise SystemExit("bench matmul: the native kernels do not build here (see the log)")
    if args.ragged:
        return ragged(jnp.dtype(args.dtype), args.repeats)
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = jnp.dtype(args.dtype)
    if args.strides:
        return strides.report(weight_shapes(REFERENCE_CONFIG), rows_list, dtype, args.repeats)
    targets = dense_native.targets()
    ours = jax.jit(lambda x, w: dense_native.matmul(targets, x, w))
    xla = jax.jit(lambda x, w: xla_matmul(x.astype(w.dtype), w))  # as `Linear` runs it
    rng = np.random.default_rng(0)
    print(
        f"{'x @ w':>24} {'native ms':>10} {'xla ms':>8} {'ratio':>6} {'GB/s native':>12} "
        f"{'xla':>6}  dispatch"
    )
    for k, n in weight_shapes(REFERENCE_CONFIG):
        nbytes = dtype.itemsize * k * n
        ws = uncached_copies(jnp.asarray(rng.normal(0, 0.02, (k, n)), dtype))
        for m in rows_list:
            x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
            t_ours = per_call_seconds(ours, x, ws, args.repeats)
            t_xla = per_call_seconds(xla, x, ws, args.repeats)
            picked = native_matmul_picked(m, n, dtype)
            print(
                f"{f'[{m},{k}] x [{k},{n}]':>24} {t_ours * 1e3:>10.3f} {t_xla * 1e3:>8.3f} "
                f"{t_xla / t_ours:>5.2f}x {nbytes / t_ours / 1e9:>12.1f} "
                f"{nbytes / t_xla / 1e9:>6.1f}  {'native' if picked else 'xla'}"
            )


def ragged(dtype: jnp.dtype, repeats: int) -> None:
    """The grouped matmul of `--ragged`: native against XLA's `ragged_dot`, per row count."""
    experts, k = MOE_CONFIG["num_experts"], MOE_CONFIG["num_experts_per_tok"]
    h, i = MOE_CONFIG["hidden_size"], MOE_CONFIG["moe_intermediate_size"]
    targets = ragged_native.targets()
    ours = jax.jit(lambda x, w, g: ragged_native.ragged_matmul(targets, x, w, g))
    xla = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x.astype(w.dtype), w, g))
    rng = np.random.default_rng(0)
    print(f"{'x @ w[group]':>28} {'native ms':>10} {'xla ms':>8} {'ratio':>7}")
    for shape in ((experts, h, i), (experts, i, h)):
        ws = uncached_copies(jnp.asarray(rng.normal(0, 0.02, shape), dtype))
        for rows in (k, 8 * k, 32 * k, 128 * k, 32 * 128 * k):
            choice = rng.integers(0, experts, rows)
            sizes = jnp.asarray(np.bincount(choice, minlength=experts), jnp.int32)
            x = jnp.asarray(rng.normal(size=(rows, shape[1])), jnp.float32)
            t_ours = per_call_seconds(lambda x, w, sizes=sizes: ours(x, w, sizes), x, ws, repeats)
            t_xla = per_call_seconds(lambda x, w, sizes=sizes: xla(x, w, sizes), x, ws, repeats)
            name = f"[{rows},{shape[1]}] x {list(shape)}"
            print(f"{name:>28} {t_ours * 1e3:>10.3f} {t_xla * 1e3:>8.3f} {t_xla / t_ours:>6.1f}x")
