"""The one binding a runner reads at use: the placed state and the programs that run on it.

A `Binding` pairs a `Placement` with the arrays placed by it (parameters and pools) and runs a
step as a chain of stage programs (`stage_chain`: how a step is cut into pieces and handed from
stage to stage). Single device and TP are the one-stage case of the same runner.

Programs are compiled ahead of time from abstract shapes (`compile_programs`) and cached per
process (`program_cache`) by (model, kernel mode, placement, pool shapes, stage, shape), so
arming a layout before a flip leaves nothing to compile after it. Nothing outside the binding
keeps a reference to its arrays: a flip builds a new binding and swaps it in whole.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flipjax.model.config import ModelConfig
from flipjax.model.gated_deltanet import GDNState
from flipjax.runtime.cache import CacheState, GDNSlots, kv_scaled
from flipjax.runtime.compile_counter import CompileCounter
from flipjax.runtime.cpu_dots import step_compiler_options
from flipjax.runtime.crosshost import reshard
from flipjax.runtime.host_image import HostImage
from flipjax.runtime.paged import (
    Scores,
    conv_in_place,
    stage_step,
    updates_in_place,
    write_chain,
    write_slots,
    writing,
)
from flipjax.runtime.placement import REPLICATED, Placement
from flipjax.runtime.pool_programs import placed_zeros
from flipjax.runtime.program_cache import PROGRAMS
from flipjax.runtime.program_store import compile_program
from flipjax.runtime.stage_chain import Shape, StageChain
from flipjax.runtime.stages import ModelParts, stage_params


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class Binding(StageChain):
    def __init__(
        self,
        placement: Placement,
        cfg: ModelConfig,
        parts: ModelParts,
        kernels: str,
        params: nnx.State,
        state: CacheState,
        dtype: jnp.dtype,
        table_width: int,
        compiles: CompileCounter,
        hidden: bool = False,
    ):
        """`hidden`: the steps also return the final-normed hidden state at every position
        (a speculative engine's: the MTP head drafts from it)."""
        self.placement = placement
        self.cfg = cfg
        self.parts = parts
        self.kernels = kernels
        self.params = params
        self.dtype = dtype
        self.table_width = table_width
        self.compiles = compiles
        self.hidden = hidden
        self.stages = placement.stages
        # Each stage's parameters as a flat tuple of arrays: a compiled call flattens its
        # arguments on every step, and the nnx State's nodes made that cost 0.35-0.4 ms a step.
        self._params = [tuple(jax.tree.leaves(stage_params(params, s.span))) for s in self.stages]
        self._kv_ids = [s.span.attention_layers(cfg) for s in self.stages]
        self._gdn_ids = [s.span.gdn_layers(cfg) for s in self.stages]
        self._inputs = [NamedSharding(s.mesh, REPLICATED) for s in self.stages]
        self.sampler_device = jax.devices()[0]  # process 0's: only it samples
        self.state = state
        pools = tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))
        dtypes = tuple(sorted({str(x.dtype) for x in jax.tree.leaves(params)}))
        self._key_base = (cfg, parts, kernels, placement.key, pools, dtypes, table_width, hidden)
        # Hashing the key (the model's graph definitions) costs about a millisecond; a step
        # looks its programs up here instead.
        self._found: dict[tuple[int, Shape, int | None, bool], tuple[Any, Any, bool]] = {}

    @classmethod
    def place(
        cls,
        placement: Placement,
        params: nnx.State,
        image: HostImage | None,
        pools: CacheState,
        **binding: Any,
    ) -> Binding:
        """Bind `params` placed where `placement` says, written from their host `image` shard
        by shard (without one, copied from `params`), and pools of zeros of the shapes of
        `pools` made on their devices: nothing is staged on one device first."""
        shardings = placement.param_shardings(params)
        if image is not None:
            params = image.tree(image.place(shardings))
        else:
            params = reshard(params, shardings)
        state_sh = placement.state_shardings(binding["cfg"], kv_scales=kv_scaled(pools))
        state = jax.tree.map(lambda x, s: placed_zeros(x.shape, x.dtype, s), pools, state_sh)
        return cls(placement, params=params, state=state, **binding)

    @property
    def state(self) -> CacheState:
        return CacheState(
            kv=tuple(x for kv in self._kv for x in kv),
            gdn=tuple(x for gdn in self._gdn for x in gdn),
        )

    @state.setter
    def state(self, state: CacheState) -> None:
        self._kv = [tuple(state.kv[i] for i in ids) for ids in self._kv_ids]
        self._gdn = [tuple(state.gdn[i] for i in ids) for ids in self._gdn_ids]

    def rebind(self, placement: Placement, params: nnx.State, state: CacheState) -> Binding:
        """A binding of the same model and programs' keys over `params` and `state` placed by
        `placement` (arrays already there, or abstract when only shapes are read)."""
        return Binding(
            placement,
            self.cfg,
            self.parts,
            self.kernels,
            params,
            state,
            self.dtype,
            self.table_width,
            self.compiles,
            self.hidden,
        )

    def programs(
        self, stage: int, shape: Shape, score: int | None = None, verify: bool = False
    ) -> tuple[Any, Any]:
        """Stage `stage`'s compiled (step, write) for `shape`."""
        step, write, _ = self._stage_programs(stage, shape, score, verify)
        return step, write

    def _stage_programs(
        self, stage: int, shape: Shape, score: int | None = None, verify: bool = False
    ) -> tuple[Any, Any, bool]:
        """(step, write, whether the step updates the GDN pools itself)."""
        found = self._found.get((stage, shape, score, verify))
        if found is not None:
            return found
        key = self._key(stage, shape, score, verify)
        if key not in PROGRAMS:
            with self.compiles.watch():
                compile_programs(self, [shape], stages=[stage], score=score, verify=verify)
        self._found[(stage, shape, score, verify)] = PROGRAMS[key]
        return PROGRAMS[key]

    def compiled(self, placement: Placement | None = None) -> list[tuple[int, Any, Any]]:
        """(stage, step, write) of every program compiled so far in this process for this
        binding's model and pools over `placement` (default: its own): what the memory
        ledger reads the workspace of."""
        key = (placement or self.placement).key
        cfg, pools = self._key_base[0], self._key_base[4]
        return [
            (k[8], step, write)
            for k, (step, write, _) in list(PROGRAMS.items())
            if k[3] == key and k[0] == cfg and k[4] == pools
        ]

    def _key(
        self, stage: int, shape: Shape, score: int | None = None, verify: bool = False
    ) -> tuple[Any, ...]:
        return (*self._key_base, stage, shape, score, verify)


def compile_programs(
    binding: Binding,
    shapes: Iterable[Shape],
    stages: Iterable[int] | None = None,
    score: int | None = None,
    verify: bool = False,
) -> None:
    """Compile the stage programs of `shapes` for `binding`'s placement, from abstract shapes
    (with `score`, the last stage's scoring variant that also returns prompt logprobs; with
    `verify`, a speculative verify step's: `paged.stage_step`).

    Only the binding's placement and the shapes and dtypes of its arrays are read, so this can
    run for a layout before any array moves to it (arming).
    """
    cfg, placement = binding.cfg, binding.placement
    state_sh = placement.state_shardings(cfg, kv_scales=kv_scaled(binding.state))
    params = _abstract(binding.params, placement.param_shardings(binding.params))
    state = _abstract(binding.state, state_sh)
    shapes = list(shapes)
    for s in stages if stages is not None else range(len(binding.stages)):
        span, mesh = binding.stages[s].span, binding.stages[s].mesh
        rep = binding._inputs[s]
        kv = tuple(state.kv[i] for i in binding._kv_ids[s])
        gdn = tuple(state.gdn[i] for i in binding._gdn_ids[s])
        kv_sh = tuple(state_sh.kv[i] for i in binding._kv_ids[s])
        gdn_sh = tuple(state_sh.gdn[i] for i in binding._gdn_ids[s])
        # A layer's per-row GDN states are sharded like its slot pool (same axes after 0; a
        # verify step's have a position axis after the row's).
        row = _per_position if verify else (lambda sh: sh)
        rows_sh = tuple(GDNState(row(g.recurrent), row(g.conv)) for g in gdn_sh)
        scoring = score if span.last else None
        out_sh = rep if scoring is None else (rep, Scores(rep, rep, rep))
        out_sh = (out_sh, rep) if binding.hidden and span.last else out_sh
        stage_fn = functools.partial(
            stage_step,
            cfg,
            binding.parts,
            span,
            binding.kernels,
            scoring,
            mesh,
            verify=verify,
            hidden=binding.hidden,
        )
        leaves, tree = jax.tree.flatten(stage_params(params, span))
        written = write_chain if verify else write_slots
        writer = functools.partial(writing, binding.kernels, mesh, written)
        write_jit = dict(donate_argnums=(0,), out_shardings=gdn_sh)
        for b, t in shapes:
            key = binding._key(s, (b, t), scoring, verify)
            if key in PROGRAMS:
                continue
            in_place = updates_in_place(cfg, binding.kernels, mesh)
            # Where the conv runs in the slots too, the step returns no rows at all.
            own = conv_in_place(cfg, binding.kernels, mesh, gdn, verify)
            in_place_sh = (
                gdn_sh,
                tuple(GDNState(None, None if own else row(g.conv)) for g in gdn_sh),
            )
            step_jit = dict(
                donate_argnums=(1, 2) if in_place else (1,),
                out_shardings=(out_sh, kv_sh, in_place_sh if in_place else rows_sh),
            )
            ints = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=rep)
            x = (
                ints((b, t))
                if span.first
                else jax.ShapeDtypeStruct((b, t, cfg.hidden_size), binding.dtype, sharding=rep)
            )
            # The targets of a scoring step, or the chain of a verify step's GDN states.
            extra = (ints((b, t)),) if scoring is not None or verify else ()
            step = compile_program(
                (*key, "step"),
                functools.partial(_from_leaves, tree, stage_fn),
                step_jit,
                (
                    tuple(leaves),
                    kv,
                    gdn,
                    x,
                    ints((b, t)),
                    ints((b, binding.table_width)),
                    ints((b,)),
                    *extra,
                ),
                step_compiler_options(mesh, binding.dtype, b * t),
            )
            per_row = (b, t) if verify else (b,)  # a verify step keeps every position's state
            rows = tuple(
                GDNState(
                    *(
                        None
                        if in_place and name == "recurrent" or own and name == "conv"
                        else jax.ShapeDtypeStruct(
                            (*per_row, *a.shape[1:]), a.dtype, sharding=a.sharding
                        )
                        for name, a in zip(GDNSlots._fields, pool, strict=True)
                    )
                )
                for pool in gdn
            )
            write = compile_program((*key, "write"), writer, write_jit, (gdn, ints(per_row), rows))
            PROGRAMS[key] = (step, write, in_place)


def _per_position(sharding: NamedSharding) -> NamedSharding:
    """A pool's sharding for states [B, T, ...]: the pool's axes after a position axis."""
    spec = sharding.spec
    return NamedSharding(sharding.mesh, PartitionSpec(spec[0] if spec else None, None, *spec[1:]))


def _from_leaves(tree: Any, step: Any, leaves: tuple[jax.Array, ...], *args: Any) -> Any:
    """`step` over the stage parameters that `leaves` flatten (in `tree`'s order)."""
    return step(jax.tree.unflatten(tree, leaves), *args)
