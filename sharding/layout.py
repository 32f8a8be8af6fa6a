"""Layouts: tensor parallel (`TP`) and uneven stage pipelines (`PP`), and their placements.

A layout is a description (`tp:2`, `pp:5,3`, `pp:4,4@2,2`); `placement_for` checks it against
the model and the devices and turns it into a `flipjax.runtime.placement.Placement` that maps every
leaf of the engine state to a `NamedSharding`. Under TP, attention and GDN heads and MLP and
expert intermediate dimensions are split Megatron-style (column-parallel in, row-parallel out)
over a mesh axis "tp"; KV heads are split when the width divides them and replicated otherwise;
small tensors (norms, conv, gates) are replicated. Under PP each stage holds only its layers,
and a stage with several devices runs TP inside. A layout that cannot hold the model is
refused with `LayoutError` naming the field, before anything moves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flipjax.model.config import ModelConfig
from flipjax.model.scale_names import weight_name
from flipjax.runtime.placement import (
    REPLICATED,
    ParamRule,
    Placement,
    StagePlacement,
    replicate_all,
    single_device,
)
from flipjax.runtime.stages import StageSpan

AXIS = "tp"


class LayoutError(ValueError):
    """A layout the model or the machine cannot take; nothing was moved."""


@dataclass(frozen=True)
class Single:
    def __str__(self) -> str:
        return "single"


@dataclass(frozen=True)
class TP:
    width: int | None = None  # None: every device

    def __str__(self) -> str:
        return "tp" if self.width is None else f"tp:{self.width}"


@dataclass(frozen=True)
class PP:
    stage_layers: tuple[int, ...]
    stage_widths: tuple[int, ...] | None = None  # devices per stage; None: one each

    def __str__(self) -> str:
        text = "pp:" + ",".join(map(str, self.stage_layers))
        if self.stage_widths is not None:
            text += "@" + ",".join(map(str, self.stage_widths))
        return text


Layout = Single | TP | PP


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise LayoutError(
            f"layout: {what} {text!r} is not a comma-separated list of integers"
        ) from None
    if any(v <= 0 for v in values):
        raise LayoutError(f"layout: {what} {text!r} must all be positive")
    return values


def parse_layout(text: str | Layout) -> Layout:
    """`single`, `tp`, `tp:4`, `pp:32,16,16` or `pp:32,16,16@4,2,2`."""
    if isinstance(text, Single | TP | PP):
        return text
    text = text.strip().lower()
    if text == "single":
        return Single()
    if text == "tp":
        return TP()
    if m := re.fullmatch(r"tp:(.+)", text):
        return TP(_ints(m.group(1), "tp width")[0])
    if m := re.fullmatch(r"pp:([^@]+)(?:@(.+))?", text):
        layers = _ints(m.group(1), "stage layers")
        widths = _ints(m.group(2), "stage widths") if m.group(2) else None
        if widths is not None and len(widths) != len(layers):
            raise LayoutError(
                f"layout: {len(layers)} stages but {len(widths)} stage widths in {text!r}"
            )
        return PP(layers, widths)
    raise LayoutError(
        f"layout: {text!r} is not one of single, tp, tp:N, pp:L1,L2,... or pp:L1,...@W1,..."
    )


def scale_spec(rule: ParamRule, weight: str, shape: tuple[int, ...]) -> PartitionSpec:
    """The spec of a quantized weight's scales ([..., out]; `flipjax.model.scale_names`): split
    as the weight's output dimension is, and whole where the weight is split by its input rows:
    each shard keeps its own columns'."""
    # The weight is [..., in, out]; its rule reads `in` only to ask whether the width divides
    # it, and a row split leaves the scales whole whatever the answer.
    spec = tuple(rule(weight, (*shape[:-1], 0, shape[-1])))
    spec = spec + (None,) * (len(shape) + 1 - len(spec))
    return PartitionSpec(*spec[:-2], spec[-1])


def tp_rule(cfg: ModelConfig, width: int) -> tuple[ParamRule, PartitionSpec, PartitionSpec]:
    """The parameter rule and the KV and GDN-state specs of TP over `width` devices."""
    for field in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        if getattr(cfg, field) % width:
            raise LayoutError(
                f"layout: tp width {width} does not divide {field}={getattr(cfg, field)}, "
                "and those heads cannot be replicated"
            )
    if width == 1:
        return replicate_all, REPLICATED, REPLICATED
    split_kv = cfg.num_key_value_heads % width == 0

    def rule(name: str, shape: tuple[int, ...]) -> PartitionSpec:
        if (weight := weight_name(name)) is not None:
            return scale_spec(rule, weight, shape)
        leaf = name.split(".layers.")[-1].split(".", 1)[-1] if ".layers." in name else name
        # A Linear's kernel is [in, out]: column-parallel splits out, row-parallel splits in.
        if leaf.endswith(("q_proj.kernel", "in_proj_qkvz.kernel", "in_proj_ba.kernel")):
            return PartitionSpec(None, AXIS)
        if leaf.endswith(("k_proj.kernel", "v_proj.kernel")):
            return PartitionSpec(None, AXIS) if split_kv else REPLICATED
        if leaf.endswith(("o_proj.kernel", "out_proj.kernel")) or (
            leaf.endswith("down_proj.kernel") and shape[0] % width == 0
        ):
            return PartitionSpec(AXIS, None)
        if leaf.endswith(("gate_proj.kernel", "up_proj.kernel")) and shape[1] % width == 0:
            return PartitionSpec(None, AXIS)
        if leaf.endswith(("experts.gate_proj", "experts.up_proj")) and shape[2] % width == 0:
            return PartitionSpec(None, None, AXIS)
        if leaf.endswith("experts.down_proj") and shape[1] % width == 0:
            return PartitionSpec(None, AXIS, None)
        if name == "lm_head.kernel" and shape[1] % width == 0:
            return PartitionSpec(None, AXIS)
        if name == "model.embed_tokens.weight" and shape[1] % width == 0:
            return PartitionSpec(None, AXIS)
        return REPLICATED

    kv_spec = PartitionSpec(None, None, AXIS, None) if split_kv else REPLICATED
    return rule, kv_spec, PartitionSpec(None, AXIS, None, None)


def placement_for(
    layout: str | Layout, cfg: ModelConfig, devices: list[jax.Device] | None = None
) -> Placement:
    """Check `layout` against the model and devices; refuse with `LayoutError` or place."""
    layout = parse_layout(layout)
    devices = list(devices if devices is not None else jax.devices())
    n = cfg.num_hidden_layers
    if isinstance(layout, Single):
        return single_device(cfg, devices[0])
    if isinstance(layout, TP):
        spans, widths = [StageSpan(0, n, n)], [layout.width or len(devices)]
    else:
        if sum(layout.stage_layers) != n:
            raise LayoutError(
                f"layout: stage layers {list(layout.stage_layers)} sum to "
                f"{sum(layout.stage_layers)}, but the model has {n} layers"
            )
        if cfg.tie_word_embeddings and len(layout.stage_layers) > 1:
            raise LayoutError(
                "layout: this model ties its head to the embedding, which would have to live "
                "on the first and the last stage; use tp instead"
            )
        bounds = np.cumsum((0, *layout.stage_layers)).tolist()
        spans = [StageSpan(a, b, n) for a, b in zip(bounds, bounds[1:], strict=False)]
        widths = list(layout.stage_widths or (1,) * len(spans))
    if sum(widths) > len(devices):
        raise LayoutError(
            f"layout: {layout} needs {sum(widths)} devices, only {len(devices)} are available"
        )
    rules = {w: tp_rule(cfg, w) for w in set(widths)}  # refuses a width the heads cannot take
    stages, start = [], 0
    for span, width in zip(spans, widths, strict=True):
        mesh = Mesh(np.array(devices[start : start + width]), (AXIS,))
        rule, kv_spec, rec_spec = rules[width]
        stages.append(StagePlacement(span, mesh, rule, kv_spec, rec_spec, REPLICATED))
        start += width
    return Placement(name=str(layout), stages=tuple(stages))
