"""Where every leaf of the one logical engine state lives: a `Placement`.

A placement is a list of stages, each a span of layers on a mesh of its own devices, plus the
partition rule of each leaf inside its stage's mesh. It says where things live and nothing
else: page ids, slot ids and the parameter tree are the same under every placement. The
layouts (`sharding/layout.py`) build placements for tensor parallel and pipelines; the
single-device placement, the default, is built here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flipjax.model.config import ModelConfig
from flipjax.model.weights import param_name
from flipjax.runtime.cache import CacheState, GDNSlots, KVPages
from flipjax.runtime.stages import StageSpan

REPLICATED = PartitionSpec()
# (parameter path like "model.layers.3.self_attn.q_proj.kernel", shape) -> spec in its stage
ParamRule = Callable[[str, tuple[int, ...]], PartitionSpec]


@dataclass(frozen=True)
class StagePlacement:
    """A stage's layers, its devices, and how each of its leaves is partitioned over them."""

    span: StageSpan
    mesh: Mesh
    param_rule: ParamRule
    kv_spec: PartitionSpec  # for [pages, page_size, kv_heads, head_dim]
    recurrent_spec: PartitionSpec  # for [slots, v_heads, dk, dv]
    conv_spec: PartitionSpec  # for [slots, kernel - 1, conv_dim]


@dataclass(frozen=True)
class Placement:
    name: str  # the layout's text form, e.g. "tp:4" or "pp:4,4"
    stages: tuple[StagePlacement, ...]

    @property
    def key(self) -> tuple[Any, ...]:
        """Identity for program caches: the name and the devices of every stage."""
        return (self.name, tuple(tuple(d.id for d in s.mesh.devices.flat) for s in self.stages))

    @property
    def devices(self) -> list[jax.Device]:
        return [d for s in self.stages for d in s.mesh.devices.flat]

    def stage_of_layer(self, layer: int) -> int:
        return next(i for i, s in enumerate(self.stages) if layer in s.span.layers)

    def _stage_of_param(self, path: str) -> int:
        parts = path.split(".")
        if parts[:2] == ["model", "layers"]:
            return self.stage_of_layer(int(parts[2]))
        if parts[:2] == ["model", "embed_tokens"]:
            return 0
        return len(self.stages) - 1  # final norm and head

    def param_shardings(self, params: nnx.State) -> nnx.State:
        def sharding(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
            name = param_name(path)
            stage = self.stages[self._stage_of_param(name)]
            return NamedSharding(stage.mesh, stage.param_rule(name, tuple(leaf.shape)))

        return jax.tree_util.tree_map_with_path(sharding, params)

    def state_shardings(self, cfg: ModelConfig, *, kv_scales: bool) -> CacheState:
        """Where each pool leaf lives; `kv_scales`: the KV pages are 8-bit, with scales
        [pages, kv_heads] split like the pages' KV heads (`cache.kv_scaled`)."""

        def stage(layer: int) -> StagePlacement:
            return self.stages[self.stage_of_layer(layer)]

        def kv_layer(i: int) -> KVPages:
            mesh, spec = stage(i).mesh, stage(i).kv_spec
            pages = (NamedSharding(mesh, spec),) * 2
            if not kv_scales:
                return KVPages(*pages)
            scale = NamedSharding(mesh, PartitionSpec(*spec[:1], *spec[2:3]))
            return KVPages(*pages, scale, scale)

        kv = tuple(kv_layer(i) for i in cfg.full_attention_layers)
        gdn = tuple(
            GDNSlots(
                NamedSharding(stage(i).mesh, stage(i).recurrent_spec),
                NamedSharding(stage(i).mesh, stage(i).conv_spec),
            )
            for i in cfg.linear_attention_layers
        )
        return CacheState(kv=kv, gdn=gdn)


def single_device(cfg: ModelConfig, device: jax.Device | None = None) -> Placement:
    """Everything on one device: one stage, nothing partitioned."""
    mesh = Mesh(np.array([device or jax.devices()[0]]), ("tp",))
    span = StageSpan(0, cfg.num_hidden_layers, cfg.num_hidden_layers)
    stage = StagePlacement(span, mesh, replicate_all, REPLICATED, REPLICATED, REPLICATED)
    return Placement(name="single", stages=(stage,))


def replicate_all(name: str, shape: tuple[int, ...]) -> PartitionSpec:
    return REPLICATED
