"""Run a kernel per device over its own shard of heads (`shard_map`), under tensor parallelism.

A Pallas call is opaque to the partitioner: handed arrays sharded over heads, it gathers them
whole onto every device and runs the full kernel there, so every decode step would move the KV
pools across devices. Inside `across(mesh)` (entered by the stage step of a layout whose mesh
has more than one device) the kernels are wrapped in `shard_map` over the mesh's one axis
instead, with the specs the layouts give the pools: heads split, everything else replicated. The
pure-JAX references need none of this; the partitioner splits them by itself.

Attention's KV heads may be fewer than the devices (they are then replicated); when each
device's query heads share one KV head, the device slices it out, and otherwise (a rare head
count) the call is left to the partitioner.

It sits at the top of `kernels_pallas`, not in an operation's folder, because it serves them
all: paged attention (Pallas and native), the gated delta rule (Pallas, and the native pooled
update and the norm after it), the experts' grouped matmul (split as the layouts split experts:
by their intermediate dimension) and the matmul (which asks `local()` whether a program runs on
one device); one mesh, entered once per stage step, applies to every kernel in it. This module
imports nothing from flipjax.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

_mesh: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "flipjax_head_mesh", default=None
)
_local: contextvars.ContextVar[bool] = contextvars.ContextVar("flipjax_one_device", default=False)


@contextlib.contextmanager
def across(mesh: Mesh | None) -> Iterator[None]:
    """Kernels called inside run per device over `mesh`'s one axis (a no-op for one device)."""
    if mesh is not None and len(mesh.axis_names) != 1:
        raise ValueError(f"head parallel: a 1-D mesh is needed, got axes {mesh.axis_names}")
    token = _mesh.set(mesh if mesh is not None and mesh.size > 1 else None)
    local = _local.set(mesh is not None and mesh.size == 1)
    try:
        yield
    finally:
        _local.reset(local)
        _mesh.reset(token)


def current() -> Mesh | None:
    return _mesh.get()


def local() -> bool:
    """Whether the program being traced is known to run on one device (inside `across` with a
    one-device mesh), so a kernel the partitioner cannot split may take whole operands."""
    return _local.get()


def kv_heads_split(mesh: Mesh, heads: int, kv_heads: int) -> bool:
    """Whether `attention` runs a kernel per device over `mesh`: each device's query heads
    within one KV head's group or its own KV heads (else the partitioner runs it, gathering
    what a custom call takes)."""
    width = mesh.size
    return not kv_heads % width or (
        not heads % width and not (heads // kv_heads) % (heads // width)
    )


def attention(kernel: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """`kernel(q, k_pages, v_pages, page_table, positions, k_scale=, v_scale=)` per device over
    its query heads; 8-bit pages' scales [pages, kv_heads] go with their KV heads."""
    (axis,) = mesh.axis_names
    width = mesh.shape[axis]
    heads, head_scales = P(None, None, axis, None), P(None, axis)

    def run(q, k_pages, v_pages, page_table, positions, k_scale=None, v_scale=None):
        h, hkv = q.shape[2], k_pages.shape[2]
        per_device, group = h // width, h // hkv
        scaled = k_scale is not None
        if hkv % width == 0:
            kv, scale_spec = heads, head_scales

            def local(q, k, v, table, pos, *scales):
                return kernel(q, k, v, table, pos, **_named(scales))

        elif h % width == 0 and group % per_device == 0:

            def local(q, k, v, table, pos, *scales):
                first = jax.lax.axis_index(axis) * per_device // group
                k, v = (jax.lax.dynamic_slice_in_dim(a, first, 1, axis=2) for a in (k, v))
                scales = [jax.lax.dynamic_slice_in_dim(a, first, 1, axis=1) for a in scales]
                return kernel(q, k, v, table, pos, **_named(scales))

            kv = scale_spec = P()
        else:  # a device's query heads span several KV heads: left to the partitioner
            return kernel(
                q, k_pages, v_pages, page_table, positions, k_scale=k_scale, v_scale=v_scale
            )
        scales = (k_scale, v_scale) if scaled else ()
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(heads, kv, kv, P(), P(), *(scale_spec,) * len(scales)),
            out_specs=heads,
            check_vma=False,
        )(q, k_pages, v_pages, page_table, positions, *scales)

    return run


def rows(kernel: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """`kernel(pool, rows, ids)` (KV rows into a page pool, both [..., kv_heads, head_dim]) per
    device over its KV heads where they split over the mesh, as the layouts split them; a pool
    of replicated heads is written whole on every device."""
    (axis,) = mesh.axis_names

    def run(pool: jax.Array, rows: jax.Array, ids: jax.Array) -> jax.Array:
        split = pool.shape[-2] % mesh.shape[axis] == 0

        def heads(x: jax.Array) -> P:
            return P(*[None] * (x.ndim - 2), axis, None) if split else P()

        return jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(heads(pool), heads(rows), P()),
            out_specs=heads(pool),
            check_vma=False,
        )(pool, rows, ids)

    return run


def per_head(kernel: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """`kernel(x, z, weight)` (x and z [..., H, D], weight [D]: a norm within each head) per
    device over its heads; H must split evenly over the mesh."""
    (axis,) = mesh.axis_names

    def run(x: jax.Array, z: jax.Array, weight: jax.Array) -> jax.Array:
        heads = P(*[None] * (x.ndim - 2), axis, None)
        return jax.shard_map(
            kernel, mesh=mesh, in_specs=(heads, heads, P()), out_specs=heads, check_vma=False
        )(x, z, weight)

    return run


def _named(scales: Sequence[jax.Array]) -> dict[str, jax.Array]:
    return dict(zip(("k_scale", "v_scale"), scales, strict=False))


def delta_rule(
    kernel: Callable[..., tuple[jax.Array, jax.Array]], mesh: Mesh
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`kernel(q, k, v, g, beta, state, valid)` per device over its key and value heads (both
    split, so each key head stays with the value heads it serves)."""
    (axis,) = mesh.axis_names
    heads, gates, state = P(None, None, axis, None), P(None, None, axis), P(None, axis, None, None)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(heads, heads, heads, gates, gates, state, P()),
        out_specs=(heads, state),
        check_vma=False,
    )


def pooled_delta_rule(
    kernel: Callable[..., tuple[jax.Array, jax.Array]], mesh: Mesh
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`kernel(pool, reads, writes, q, k, v, g, beta, valid)` per device over its key and value
    heads, updating its own shard of the slot pool ([S, H, dk, dv], split over H)."""
    (axis,) = mesh.axis_names
    heads, gates, state = P(None, None, axis, None), P(None, None, axis), P(None, axis, None, None)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(state, P(), P(), heads, heads, heads, gates, gates, P()),
        out_specs=(heads, state),
        check_vma=False,
    )


def matmul(
    kernel: Callable[..., jax.Array], mesh: Mesh, split: str, w_shape: tuple[int, ...]
) -> Callable[..., jax.Array]:
    """`kernel(x, w)` (w [K, N]) per device over its shard of w (see `_split_weight`)."""
    return _split_weight(kernel, mesh, split, w_shape, extra=())


def ragged_matmul(
    kernel: Callable[..., jax.Array], mesh: Mesh, split: str, w_shape: tuple[int, ...]
) -> Callable[..., jax.Array]:
    """`kernel(x, w, group_sizes)` (w [G, K, N]) per device over its shard of the experts'
    intermediate dimension (see `_split_weight`)."""
    return _split_weight(kernel, mesh, split, w_shape, extra=(P(),))


def _split_weight(
    kernel: Callable[..., jax.Array],
    mesh: Mesh,
    split: str,
    w_shape: tuple[int, ...],
    extra: tuple[P, ...],
) -> Callable[..., jax.Array]:
    """`kernel(x, w, *rest)` per device over its shard of w ([..., K, N]), where the TP layout
    splits it: N for `split` "out" (x whole, the output split by columns), K for "in" (x split
    by columns, the partial products summed over the mesh). Where the width does not divide
    that dimension the layout replicates w, and every device runs the whole product. `extra`:
    the specs of `rest`."""
    (axis,) = mesh.axis_names
    lead = (None,) * (len(w_shape) - 2)
    dim = len(w_shape) - 1 if split == "out" else len(w_shape) - 2
    local = kernel
    if w_shape[dim] % mesh.shape[axis]:
        specs, out = (P(), P()), P()
    elif split == "out":
        specs, out = (P(), P(*lead, None, axis)), P(None, axis)
    else:
        specs, out = (P(None, axis), P(*lead, axis, None)), P()

        def local(x: jax.Array, w: jax.Array, *rest: jax.Array) -> jax.Array:
            return jax.lax.psum(kernel(x, w, *rest), axis)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(*specs, *extra), out_specs=out, check_vma=False
    )
