"""The model cut into consecutive stages of layers, over the one parameter tree.

A stage runs layers [first, last) of the model; the first stage also embeds the tokens and the
last also applies the final norm and the head. Single device and tensor parallel are one stage
over every layer; a pipeline is several. Stage parameters are views into the one logical tree
(`stage_params` selects, it never copies), so a layout change moves leaves and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import ModelConfig

StageParams = dict[str, Any]


@dataclass(frozen=True)
class StageSpan:
    """Layers [start, stop) of a model with `num_layers` layers."""

    start: int
    stop: int
    num_layers: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.num_layers

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def attention_layers(self, cfg: ModelConfig) -> list[int]:
        """Indices into the KV pools (the model's full-attention layers) this stage owns."""
        return [n for n, i in enumerate(cfg.full_attention_layers) if i in self.layers]

    def gdn_layers(self, cfg: ModelConfig) -> list[int]:
        """Indices into the GDN slot pools this stage owns."""
        return [n for n, i in enumerate(cfg.linear_attention_layers) if i in self.layers]


@dataclass(frozen=True)
class ModelParts:
    """The static structure of each piece a stage may run (hashable, so programs cache on it)."""

    embed: nnx.GraphDef
    layers: tuple[nnx.GraphDef, ...]
    norm: nnx.GraphDef
    head: nnx.GraphDef | None  # None when the head is the tied embedding

    @classmethod
    def of(cls, graphdef: nnx.GraphDef, params: nnx.State) -> ModelParts:
        model = nnx.merge(graphdef, params)
        inner = model.model
        head = None if model.cfg.tie_word_embeddings else nnx.split(model.lm_head)[0]
        return cls(
            embed=nnx.split(inner.embed_tokens)[0],
            layers=tuple(nnx.split(layer)[0] for layer in inner.layers),
            norm=nnx.split(inner.norm)[0],
            head=head,
        )


def stage_params(params: nnx.State, span: StageSpan) -> StageParams:
    """The subtrees of `params` a stage reads, keyed by piece name; the arrays are shared.

    A tied head reads the embedding, so a tied model runs as one stage (layouts refuse to cut
    it): the embedding cannot live on two stages of one logical state.
    """
    inner = params["model"]
    out: StageParams = {"layers": tuple(inner["layers"][i] for i in span.layers)}
    if span.first:
        out["embed"] = inner["embed_tokens"]
    if span.last:
        out["norm"] = inner["norm"]
        if "lm_head" in params:
            out["head"] = params["lm_head"]
    return out


def stage_forward(
    parts: ModelParts,
    span: StageSpan,
    params: StageParams,
    x: jax.Array,
    positions: jax.Array,
    caches: tuple[Any, ...],
    every_position: bool = False,
    hidden: bool = False,
) -> tuple[Any, tuple[Any, ...]]:
    """x: tokens [B, T] on the first stage, hidden [B, T, hidden] otherwise.

    Returns the hidden state for the next stage or, on the last stage, float32 logits at each
    row's last real token ([B, vocab]; with `every_position`, at every token, [B, T, vocab]),
    with `hidden` paired with the final-normed hidden state at every token (what the MTP head
    drafts from): (logits, [B, T, hidden]); and the stage's new caches (one per layer).
    """
    h = nnx.merge(parts.embed, params["embed"])(x) if span.first else x
    new_caches = []
    for i, layer_params, cache in zip(span.layers, params["layers"], caches, strict=True):
        h, cache = nnx.merge(parts.layers[i], layer_params)(h, positions, cache)
        new_caches.append(cache)
    if not span.last:
        return h, tuple(new_caches)
    normed = h = nnx.merge(parts.norm, params["norm"])(h)
    if not every_position:
        last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
        h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    if parts.head is None:
        logits = jnp.einsum("...h,vh->...v", h, params["embed"]["weight"][...])
    else:
        logits = nnx.merge(parts.head, params["head"])(h)
    logits = logits.astype(jnp.float32)
    return ((logits, normed) if hidden else logits), tuple(new_caches)
