"""The one place that decides which implementation of each kernel runs.

Modes: `pallas` (compiled Pallas kernels, the default on GPU), `native` (the pure-JAX references
with the native CPU kernels of `kernels_pallas.native` where one runs a step faster: the default
on the CPU where they build), `reference` (the pure-JAX references alone) and `interpret` (the
Pallas kernels in interpret mode, so the CPU tests exercise the kernel code). `FLIPJAX_KERNELS`
overrides the default; a traced program pins a mode with `kernels(mode)` (how a compiled step
records its mode). Under `head_parallel.across(mesh)` kernels run per device over their heads.
The mode is read at trace time, never in a compiled program. This imports nothing from flipjax.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from kernels_pallas import head_parallel, native, step_rows
from kernels_pallas.gdn import native_binding as gdn_native
from kernels_pallas.gdn import reference as gdn_reference
from kernels_pallas.gdn.pallas_kernel import delta_rule_kernel
from kernels_pallas.matmul import calibration as matmul_calibration
from kernels_pallas.matmul import native_binding as matmul_native
from kernels_pallas.matmul.native_binding import SEVERAL
from kernels_pallas.matmul.xla_form import xla_int8_matmul
from kernels_pallas.paged_attention import native_binding as attention_native
from kernels_pallas.paged_attention.pages import scatter_rows
from kernels_pallas.paged_attention.pallas_kernel import tuned_paged_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference
from kernels_pallas.paged_attention.write_binding import read_rows, write_rows
from kernels_pallas.pointwise import native_binding as pointwise_native
from kernels_pallas.ragged_matmul import native_binding as ragged_native
from kernels_pallas.sampling import native_binding as sampling_native
from kernels_pallas.sampling import reference as sampling_reference

KERNELS_ENV = "FLIPJAX_KERNELS"
PREFILL_FORM_ENV = "FLIPJAX_GDN_PREFILL"
MODES = ("pallas", "native", "reference", "interpret")
REFERENCE_MODES = ("native", "reference")  # the pure-JAX forms run wherever no kernel does
NATIVE_MATMUL_MIN_COLUMNS = 128
VERIFY_TOKENS = 8  # a verify step's positions per row, at most (no prefill chunk is as short)
StateKernel = Callable[..., tuple[jax.Array, jax.Array]]  # (output, the pool updated in place)

_pinned: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernels", default=None)
_pinned_form: contextvars.ContextVar[str | None] = contextvars.ContextVar("gdn_form", default=None)


def _checked(mode: str, source: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{source}: unknown kernel mode {mode!r}; expected one of {MODES}")
    return mode


def default_mode() -> str:
    """`FLIPJAX_KERNELS`, else Pallas on GPU, native on the CPU where they build, else reference."""
    if env := os.environ.get(KERNELS_ENV):
        return _checked(env, KERNELS_ENV)
    if (backend := jax.default_backend()) == "gpu":
        return "pallas"
    return "native" if backend == "cpu" and native.available() else "reference"


def current_mode() -> str:
    """The mode pinned by an enclosing `kernels(...)`, else the default."""
    return _pinned.get() or default_mode()


@contextlib.contextmanager
def kernels(mode: str, prefill_form: str | None = None) -> Iterator[None]:
    """Pins the mode and the reference delta rule's prefill form for programs traced inside."""
    tokens = (_pinned.set(_checked(mode, "kernels()")), _pinned_form.set(prefill_form))
    try:
        yield
    finally:
        _pinned.reset(tokens[0])
        _pinned_form.reset(tokens[1])


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Attention of q [B, T, H, D] over paged K/V, by the current mode; 8-bit pages come with
    their scales [pages, kv_heads] and are widened inside the kernel."""
    mode, mesh = current_mode(), head_parallel.current()
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    native_decode = _native_decode_attention(q, k_pages) if mode == "native" else None
    if native_decode is not None:
        return native_decode(q, k_pages, v_pages, page_table, positions, **scales)
    split = mesh is None or head_parallel.kv_heads_split(mesh, q.shape[2], k_pages.shape[2])
    if mode in REFERENCE_MODES and not (_native_here() and split):
        return paged_attention_reference(q, k_pages, v_pages, page_table, positions, **scales)
    if mode in REFERENCE_MODES:  # gathers by the native kernel: XLA's widens a bf16 pool whole
        kernel = functools.partial(paged_attention_reference, read=read_rows)
    else:
        kernel = tuned_paged_attention(q.shape, k_pages.shape[2], page_table.shape[1], mode)
    kernel = kernel if mesh is None else head_parallel.attention(kernel, mesh)
    return kernel(q, k_pages, v_pages, page_table, positions, **scales)


def _native_here() -> bool:
    """Whether native kernels run in a program traced now: `native` mode, one device or across."""
    native_mode = current_mode() == "native"
    return native_mode and (head_parallel.current() is not None or head_parallel.local())


def page_writer() -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """How KV rows go into a page pool (`pages.Writer`): in `native` mode in place by the kernel,
    per device under `head_parallel.across` (XLA:CPU's scatter copies a bf16 or fp8 pool twice,
    through fp32); elsewhere by XLA's scatter."""
    if not _native_here():
        return scatter_rows
    mesh = head_parallel.current()
    return write_rows if mesh is None else head_parallel.rows(write_rows, mesh)


def _native_decode_attention(q: jax.Array, k_pages: jax.Array) -> Callable[..., jax.Array] | None:
    """The native kernel for a decode or verify step's few tokens a row, per device under
    `head_parallel.across`; None for prefill, other page dtypes, or split KV heads' groups."""
    tokens = q.shape[1]
    if tokens > VERIFY_TOKENS or jnp.dtype(k_pages.dtype) not in attention_native.HANDLERS:
        return None
    kernel, mesh = attention_native.decode, head_parallel.current()
    if mesh is not None:
        if not head_parallel.kv_heads_split(mesh, q.shape[2], k_pages.shape[2]):
            return None
        kernel = head_parallel.attention(attention_native.decode, mesh)
    return kernel if tokens == 1 else functools.partial(attention_native.per_position, kernel)


def delta_rule(num_tokens: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The delta rule over `num_tokens` tokens: the kernels in Pallas (or interpret) mode; else the
    recurrence for decode, and `prefill_form()` for prefill (XLA:CPU runs the scan 2x faster)."""
    mode = current_mode()
    if mode not in REFERENCE_MODES:
        kernel = functools.partial(delta_rule_kernel, interpret=mode == "interpret")
        mesh = head_parallel.current()
        return kernel if mesh is None else head_parallel.delta_rule(kernel, mesh)
    if num_tokens == 1:
        return gdn_reference.delta_rule_recurrent
    form = prefill_form()
    if form not in ("chunked", "recurrent"):
        raise ValueError(f"GDN prefill form: {form!r} is neither 'chunked' nor 'recurrent'")
    chunked = form == "chunked"
    return gdn_reference.delta_rule_chunked if chunked else gdn_reference.delta_rule_recurrent


def first_max(x: jax.Array) -> jax.Array:
    """Each row's first maximum: by the native kernel in `native` mode for fp32, else reference."""
    native_rows = current_mode() == "native" and x.dtype == jnp.float32
    return (sampling_native if native_rows else sampling_reference).first_max(x)


def prefill_form() -> str:
    """The reference delta rule's prefill form: pinned, `FLIPJAX_GDN_PREFILL` or the backend's."""
    form = _pinned_form.get() or os.environ.get(PREFILL_FORM_ENV)
    return form or ("recurrent" if jax.default_backend() == "cpu" else "chunked")


def pooled_delta_rule(key_heads: int, value_heads: int) -> StateKernel | None:
    """The native kernel advancing pooled GDN states in their slots (`gdn.native_binding`; XLA's
    scan took 4 ms a layer for a 128-token chunk, the kernel 1) in `native` mode, per device where
    both head counts split evenly; else None (the caller gathers rows for `delta_rule`)."""
    if current_mode() != "native":
        return None
    mesh = head_parallel.current()
    if mesh is not None and (key_heads % mesh.size or value_heads % mesh.size):
        return None
    kernel = functools.partial(gdn_native.pooled_decode, native.target("gdn_decode"))
    return kernel if mesh is None else head_parallel.pooled_delta_rule(kernel, mesh)


def pooled_conv(dtype: jnp.dtype) -> StateKernel | None:
    """The native GDN conv over pooled windows in their slots (`gdn.native_binding.pooled_conv`
    without its first argument): `native` mode, fp32, one device; else None (`causal_conv`)."""
    if current_mode() != "native" or not head_parallel.local() or dtype != jnp.float32:
        return None
    return functools.partial(gdn_native.pooled_conv, native.target("conv_pool"))


def gated_norm(dtype: jnp.dtype, heads: int, eps: float) -> Callable[..., jax.Array] | None:
    """The GDN output norm `(x, z, weight)` by the native kernel (XLA:CPU's exp is scalar there):
    `native` mode, fp32, per device where heads split evenly; else None (`RMSNormGated`)."""
    mesh = head_parallel.current()
    if not _native_here() or dtype != jnp.float32 or (mesh is not None and heads % mesh.size):
        return None
    kernel = functools.partial(gdn_native.gated_norm, native.target("gated_norm"), eps=eps)
    return kernel if mesh is None else head_parallel.per_head(kernel, mesh)


def gate(activation: str, dtype: jnp.dtype) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
    """`(g, x)` -> `silu(g) * x` or `x * sigmoid(g)` by the native kernels (`pointwise`; XLA:CPU's
    exp runs scalar beside the product): `native` mode, fp32, one device; else None."""
    if current_mode() != "native" or not head_parallel.local() or dtype != jnp.float32:
        return None
    return functools.partial(pointwise_native.gate, activation)


def matmul(rows: int, columns: int, dtype: jnp.dtype) -> Callable[..., jax.Array] | None:
    """The native kernel for fp32 `x [rows, K] @ w [K, columns]` (`matmul.native_binding`), or
    None (XLA's dot): `native` mode, one device (the partitioner would gather a custom call's
    weight), enough columns and the rows calibrated for the dtype and width, from the build
    calibrated fastest there (`native_build`: each gives the same bits)."""
    if not head_parallel.local() or current_mode() != "native":  # cheapest question first
        return None
    calibrated = matmul_calibration.native_rows(dtype, columns=columns)  # none for int8
    if columns < NATIVE_MATMUL_MIN_COLUMNS or (m := step_rows.decode_rows(rows)) not in calibrated:
        return None
    build = matmul_calibration.native_build(dtype, m, columns=columns)
    return functools.partial(matmul_native.matmul, matmul_native.targets(build))


def matmuls(rows: int, columns: Sequence[int], dtype: jnp.dtype) -> Callable[..., tuple] | None:
    """`matmul`'s choice for one x times weights of `columns` together, in one call (`matmuls`)."""
    if jnp.dtype(dtype) not in matmul_native.SEVERAL or matmul(rows, sum(columns), dtype) is None:
        return None
    build = matmul_calibration.native_build(dtype, step_rows.decode_rows(rows), None, sum(columns))
    return functools.partial(matmul_native.matmuls, matmul_native.targets(build, SEVERAL))


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, split: str) -> jax.Array:
    """`x [..., K] @ (q [K, N] * scale [N])`, int8 q with per-column scales, in x's dtype
    (accumulated in fp32), without a dequantized copy of the weight where the kernels run. In
    `native` mode `int8_matmul` chooses by row count (XLA's plain dot would write the weight
    out whole in a float type every call), per device over q's shard under `head_parallel.across`,
    `split` naming what TP splits ("out": columns; "in": rows, partial products summed).
    Elsewhere XLA's dot takes the widened weight: a block of columns at a time on the CPU
    (`xla_int8_matmul`), whole on a GPU, where the widening fuses into the GEMM."""
    if split not in ("in", "out"):
        raise ValueError(f"quantized_matmul: split must be 'in' or 'out', got {split!r}")
    rows = x.reshape(-1, x.shape[-1])
    if _native_here():
        kernel = int8_matmul(rows.shape[0], x.dtype)
        if (mesh := head_parallel.current()) is not None:
            kernel = head_parallel.matmul(kernel, mesh, split, q.shape)
        y = kernel(rows, q)
    elif jax.default_backend() == "cpu":
        y = xla_int8_matmul(rows, q)
    else:
        y = jnp.einsum("ri,io->ro", rows, q.astype(x.dtype), preferred_element_type=jnp.float32)
    y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], q.shape[1])


def int8_matmul(rows: int, dtype: jnp.dtype) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`(x [rows, K], q [K, N] int8) -> float32 [rows, N]` on the CPU: the native kernel up to
    the most rows calibrated native for x's dtype, XLA's GEMM widening a block of columns at a
    time above (it beat the kernel on the model's weights: bf16 GEMMs on bf16 dot units)."""
    calibrated = matmul_calibration.native_rows(dtype) if dtype in matmul_native.HANDLERS else ()
    if (m := step_rows.decode_rows(rows)) <= max(calibrated, default=1):
        targets = matmul_native.targets(matmul_calibration.native_build(jnp.int8, m))
        return lambda x, q: matmul_native.matmul(targets, x.astype(jnp.float32), q)
    return xla_int8_matmul


def ragged_dot(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    split: str,
    scale: jax.Array | None = None,
) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` (x [M, K] sorted by group, w [G, K, N]; with
    `scale` [G, N], w is int8 scaled per column) in x's dtype. `native` mode: the native kernel
    (XLA:CPU multiplies each row by every group), per device under `head_parallel.across`,
    `split` naming what TP splits: "out" (N) or "in" (K, partial sums summed)."""
    if split not in ("in", "out"):
        raise ValueError(f"ragged_dot: split must be 'in' or 'out', got {split!r}")
    if not _native_here():
        if scale is None:
            return jax.lax.ragged_dot(x, w, group_sizes)
        y = jax.lax.ragged_dot(
            x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32
        )
    else:
        kernel = functools.partial(ragged_native.ragged_matmul, ragged_native.targets())

        def run(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
            y = kernel(x.astype(jnp.float32), w, group_sizes)
            return y if scale is not None else y.astype(x.dtype)  # scaled in fp32 below

        if (mesh := head_parallel.current()) is not None:
            run = head_parallel.ragged_matmul(run, mesh, split, w.shape)
        y = run(x, w, group_sizes)
    if scale is not None:
        # Each sorted row takes its group's scales (rows past the groups are zero anyway).
        groups = jnp.repeat(jnp.arange(w.shape[0]), group_sizes, total_repeat_length=x.shape[0])
        y = y * scale.astype(jnp.float32)[groups]
    return y.astype(x.dtype)
