"""The MTP head as a drafter: K draft tokens per row, from the model's hidden states.

The head's attention layer keeps its own paged KV, one layer of pages indexed by the same page
ids as the model's (its K/V at position t comes from the model's hidden state at t and the
token at t + 1), so a request's page table serves both and the device prefix cache shares
them with the pages. Everything here lives on the sampler's device (process 0's first), the
head's weights and the embedding and lm head it shares with the model as copies of their own,
so a layout flip never moves or recompiles it: what it reads from the step is the hidden
states, already on that device.

Drafts only ever propose: every token is the model's own (`flipjax.engine.speculation`
verifies them), so a draft page left stale (a prefix seeded from the store, a pool resized by
a flip) costs acceptance, never a token.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flipjax.model.config import ModelConfig
from flipjax.model.mtp import Qwen3NextMTP
from flipjax.model.quantize import quantize_int8
from flipjax.model.state_shapes import state_shapes
from flipjax.runtime.cache import KVPages
from flipjax.runtime.compile_counter import CompileCounter
from flipjax.runtime.crosshost import on_device
from flipjax.runtime.paged import PagedKV
from flipjax.runtime.stages import ModelParts
from kernels_pallas import dispatch, head_parallel


def drafter_bytes(
    cfg: ModelConfig,
    head: Qwen3NextMTP,
    params: nnx.State,
    page_size: int,
    quantization: str | None = None,
) -> tuple[int, int]:
    """What a drafter of `head` holds on its device besides the model: its weights (the head's
    and its copies of the embedding and the lm head in `params`: untied, or int8 under
    `quantization`) and one KV page."""
    embed = params["model"]["embed_tokens"]
    copies = [embed, params["lm_head"] if "lm_head" in params and not quantization else {}]
    weights = sum(x.nbytes for x in jax.tree.leaves((nnx.state(head), copies)))
    if quantization:  # int8 [hidden, vocab] and a float32 scale per token
        weights += cfg.hidden_size * cfg.vocab_size + 4 * cfg.vocab_size
    dtype = jnp.dtype(embed["weight"][...].dtype)
    return weights, 2 * page_size * math.prod(state_shapes(cfg).kv_token) * dtype.itemsize


class Drafter:
    def __init__(
        self,
        cfg: ModelConfig,
        head: Qwen3NextMTP,
        parts: ModelParts,
        params: nnx.State,
        num_steps: int,
        num_pages: int,
        page_size: int,
        kernels: str,
        compiles: CompileCounter,
        quantization: str | None = None,
    ):
        """`head`: the loaded MTP head, quantized as `quantization` says
        (`quantize_draft_head`); `parts` and `params`: the model's (the embedding and lm head
        are copied from them, the lm head int8 under `quantization`); `num_steps`: drafts per
        row (K, checked by the config)."""
        if len(head.layers) != 1:
            raise ValueError(
                f"speculative decoding: the MTP head has {len(head.layers)} layers; one is "
                f"supported (every published Qwen3-Next head has one)"
            )
        self.device = jax.devices()[0]
        self.mesh = Mesh(np.array([self.device]), ("tp",))
        self.num_steps = num_steps
        self.kernels = kernels
        self.compiles = compiles
        graphdef, head_params = nnx.split(head)
        embed = params["model"]["embed_tokens"]
        shared = {"embed": embed}
        if quantization is not None:  # the largest weight a draft reads, K times a step
            tied = parts.head is None
            weight = embed["weight"][...].T if tied else params["lm_head"]["kernel"][...]
            q, scale = quantize_int8(np.asarray(weight))
            shared["lm_int8"] = {"q": q, "scale": scale}
        elif parts.head is not None:
            shared["head"] = params["lm_head"]
        self._graphdefs = (graphdef, parts)
        # Flat, as the binding keeps a stage's: a call flattens its arguments, and flattening
        # the head's module state costs more host time than the rest of a call.
        placed = jax.device_put({"mtp": head_params, **shared}, self.device)
        self._params, self._tree = jax.tree.flatten(placed)
        self._kv_shape = (page_size, *state_shapes(cfg).kv_token)
        self._dtype = embed["weight"][...].dtype
        self.bytes = drafter_bytes(cfg, head, params, page_size, quantization)  # weights, a page
        self.kv = self._zeros(num_pages)
        self._programs: dict[tuple[int, int], Any] = {}
        self._verified: dict[tuple[int, int], Any] = {}  # draft_verified's, by shape

    def _zeros(self, num_pages: int) -> KVPages:
        zeros = jnp.zeros((num_pages, *self._kv_shape), self._dtype, device=self.device)
        return KVPages(zeros, jnp.zeros_like(zeros))

    def held(self) -> tuple[Any, KVPages]:
        """The arrays it holds (on `device`): its weights and its KV pages."""
        return jax.tree.unflatten(self._tree, self._params), self.kv

    def fit(self, num_pages: int) -> None:
        """Pages for a pool of `num_pages` (a flip resized the model's: the page ids were
        renumbered, so what the old pages held is dropped; drafts recover as tokens come)."""
        if self.kv.k.shape[0] != num_pages:
            self.kv = self._zeros(num_pages)

    def draft(
        self,
        hidden: jax.Array,
        next_tokens: np.ndarray,
        positions: np.ndarray,
        table: np.ndarray,
    ) -> np.ndarray:
        """Write the head's K/V at the rows' new positions and draft K tokens after each row's
        last one. hidden: the model's final-normed hidden states [B, T, H] on this device;
        next_tokens: the token after each position [B, T]; positions: [B, T] (-1: padding);
        table: the rows' page tables [B, W]. Returns the drafts [B, K] (a row of padding
        drafts garbage)."""
        b, t = positions.shape
        if hidden.shape[:2] != (b, t):
            raise ValueError(f"draft: hidden {hidden.shape} does not match positions {(b, t)}")
        program = self._program(b, t)
        with self.compiles.watch():
            drafts, self.kv = program(
                self._params,
                self.kv,
                hidden,
                jax.device_put(next_tokens.astype(np.int32), self.device),
                jax.device_put(positions.astype(np.int32), self.device),
                jax.device_put(table.astype(np.int32), self.device),
            )
        return np.asarray(jax.device_get(drafts))

    def draft_verified(
        self,
        hidden: jax.Array,
        sampled: jax.Array,
        tokens: jax.Array | np.ndarray,
        starts: np.ndarray,
        allowed: np.ndarray,
        table: np.ndarray,
    ) -> tuple[jax.Array, jax.Array]:
        """`draft` after a verify step, dispatched behind its sampler with no trip to the host:
        each row takes the positions from `starts` (-1: none) on, as many as its drafts the
        sampled tokens agree with, the first `allowed`, plus one; the token after each is the
        one sampled there. hidden: the verify step's [B, K + 1, H]; sampled: the sampler's
        tokens for its rows, [B * (K + 1)], on this device; tokens: the step's own [B, K + 1]
        (the pending token, then the drafts checked), on the host or a device. Returns, not
        yet fetched, the new drafts [B, K] and the tokens each row took [B]."""
        b, t = hidden.shape[:2]
        if sampled.shape != (b * t,) or tokens.shape != (b, t):
            raise ValueError(
                f"draft_verified: sampled {sampled.shape} and tokens {tokens.shape} do not "
                f"match hidden {hidden.shape}"
            )
        if (b, t) not in self._verified:
            self._verified[(b, t)] = jax.jit(self._accepting(self._body()), donate_argnums=(1,))
        with self.compiles.watch():
            if isinstance(tokens, np.ndarray):
                tokens = tokens.astype(np.int32)
            # Placed as warmed up; a `device_put` of what is already there costs the host
            # more than the rest of the call.
            placed = [on_device(x, self.device) for x in (hidden, sampled, tokens)]
            new, taken, self.kv = self._verified[(b, t)](
                self._params,
                self.kv,
                *placed,
                *(a.astype(np.int32) for a in (starts, allowed, table)),
            )
        return new, taken

    def _program(self, b: int, t: int) -> Any:
        """The drafting program for [b, t] rows, compiled on first use."""
        if (b, t) not in self._programs:
            self._programs[(b, t)] = jax.jit(self._body(), donate_argnums=(1,))
        return self._programs[(b, t)]

    @staticmethod
    def _accepting(body: Any) -> Any:
        """`body` fed by a verify step's sampled tokens: the positions each row took, found on
        the device as `Speculation._commit` finds them on the host (the drafts agreed with,
        then the model's own token)."""

        def run(params, kv, hidden, sampled, tokens, starts, allowed, table):  # noqa: ANN001, ANN202
            b, t = hidden.shape[:2]
            sampled = sampled.reshape(b, t)
            agree = (sampled[:, :-1] == tokens[:, 1:]) & (jnp.arange(t - 1) < allowed[:, None])
            taken = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1) + 1
            at = jnp.arange(t)
            took = (at < taken[:, None]) & (starts[:, None] >= 0)
            positions = jnp.where(took, starts[:, None] + at, -1)
            new, pages = body(params, kv, hidden, sampled, positions, table)
            return new, jnp.where(starts >= 0, taken, 0), pages

        return run

    def _body(self) -> Any:
        """The drafting computation: (params, kv, hidden, next_tokens, positions, table) ->
        (drafts, the head's KV pages)."""
        graphdef, parts = self._graphdefs
        steps, kernels, mesh, tree = self.num_steps, self.kernels, self.mesh, self._tree

        def run(leaves, kv, hidden, next_tokens, positions, table):  # noqa: ANN001, ANN202
            params = jax.tree.unflatten(tree, leaves)
            head = nnx.merge(graphdef, params["mtp"])
            embed = nnx.merge(parts.embed, params["embed"])

            def logits(h: jax.Array) -> jax.Array:
                if "lm_int8" in params:
                    lm = params["lm_int8"]
                    return dispatch.quantized_matmul(h, lm["q"], lm["scale"], split="out")
                if parts.head is None:
                    return jnp.einsum("...h,vh->...v", h, params["embed"]["weight"][...])
                return nnx.merge(parts.head, params["head"])(h)

            with dispatch.kernels(kernels), head_parallel.across(mesh):
                h, cache = head(embed(next_tokens), hidden, positions, PagedKV(kv, table))
                last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
                h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
                pos = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0]
                token = jnp.argmax(logits(h), axis=-1).astype(jnp.int32)
                drafts = [token]
                for j in range(1, steps):
                    at = jnp.where(pos >= 0, pos + j, -1)[:, None]
                    out, cache = head(embed(token[:, None]), h[:, None], at, cache, step=j)
                    h = out[:, 0]
                    token = jnp.argmax(logits(h), axis=-1).astype(jnp.int32)
                    drafts.append(token)
            return jnp.stack(drafts, axis=1), cache.pages

        return run
