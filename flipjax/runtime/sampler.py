"""The batched sampler on the device, and the packing of per-row parameters into its inputs.

Order: penalties, then the additive bias (logit_bias, and stop tokens held back until
min_tokens), then the grammar mask, then temperature, top-k, top-p and min-p (HF's warper
order), then a draw. Temperature 0 is greedy. Each row draws with its own key,
`fold_in(key(seed), step)` where step is the number of tokens that request has generated, so a
seeded request gives the same tokens whatever else shares its batch, and after a retraction
too. Returned logprobs are of the model's own distribution (before every modifier), as vLLM
returns them. Static flags drop every stage no row needs, so a batch without grammar rows or
biases pays nothing for them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flipjax.runtime.buckets import pow2_bucket
from flipjax.runtime.sampling import SamplingParams
from kernels_pallas import dispatch


class SamplerInputs(NamedTuple):
    """Per-row arrays for one sampling call; B rows, padded rows are greedy and ignored."""

    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32, 0 = no limit
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    seed: jax.Array  # [B] u32
    step: jax.Array  # [B] i32, tokens generated so far
    prompt_ids: jax.Array  # [B, Lp] i32, -1 padded (only read with penalties)
    output_ids: jax.Array  # [B, Lo] i32, -1 padded (only read with penalties)
    bias: jax.Array  # [B, V] f32 added to the logits ([B, 1] when no row has one)
    mask: jax.Array  # [B, ceil(V / 32)] i32 allowed-token bitmask ([B, 1] when no row has one)


class SamplerOutputs(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32, of the chosen token
    top_ids: jax.Array  # [B, n] i32
    top_logprobs: jax.Array  # [B, n] f32


@dataclass
class SamplerRow:
    params: SamplingParams
    seed: int
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    bias: dict[int, float] | None = None  # token id -> added logit (-inf: never sampled)
    mask: np.ndarray | None = None  # [ceil(V / 32)] int32: bit t of word t // 32 allows t


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


def build_inputs(
    rows: list[SamplerRow | None], batch: int, vocab: int
) -> tuple[SamplerInputs | None, dict]:
    """Pack rows (None = padding) into device arrays plus the static flags the sampler needs.

    A batch that only takes the argmax (greedy rows without penalties, biases or a grammar)
    needs no per-row arrays: it gets None, and skips packing and transferring them.
    """
    greedy = SamplingParams.greedy()
    params = [r.params if r is not None else greedy for r in rows] + [greedy] * (batch - len(rows))
    num_logprobs = max((p.logprobs or 0 for p in params), default=0)
    flags = dict(
        use_penalties=any(p.uses_penalties for p in params),
        use_filters=any(p.uses_filters for p in params),
        use_random=any(p.temperature > 0 for p in params),
        use_bias=any(r is not None and r.bias for r in rows),
        use_mask=any(r is not None and r.mask is not None for r in rows),
        want_logprobs=any(p.logprobs is not None for p in params),
        num_logprobs=pow2_bucket(num_logprobs) if num_logprobs else 0,
    )
    if not any(flags[f] for f in ("use_penalties", "use_random", "use_bias", "use_mask")):
        return None, flags
    return _pack(rows, params, vocab, flags), flags


def _pack(
    rows: list[SamplerRow | None], params: list[SamplingParams], vocab: int, flags: dict
) -> SamplerInputs:
    batch = len(params)
    penalties = flags["use_penalties"]
    lp = pow2_bucket(max((len(r.prompt_ids) for r in rows if r), default=1), 16) if penalties else 1
    lo = pow2_bucket(max((len(r.output_ids) for r in rows if r), default=1), 16) if penalties else 1
    prompt = np.full((batch, lp), -1, np.int32)
    output = np.full((batch, lo), -1, np.int32)
    seeds = np.zeros(batch, np.uint32)
    steps = np.zeros(batch, np.int32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        seeds[i] = r.seed & 0xFFFFFFFF
        steps[i] = len(r.output_ids)
        if penalties:
            prompt[i, : len(r.prompt_ids)] = r.prompt_ids
            output[i, : len(r.output_ids)] = r.output_ids

    bias = np.zeros((batch, vocab if flags["use_bias"] else 1), np.float32)
    mask = np.full((batch, bitmask_words(vocab) if flags["use_mask"] else 1), -1, np.int32)
    for i, r in enumerate(rows):
        if r is not None and r.bias:
            ids = np.fromiter(r.bias, np.int64)
            bias[i, ids] = np.fromiter(r.bias.values(), np.float32)
        if r is not None and r.mask is not None:
            mask[i] = r.mask

    def col(name: str, dtype: type) -> np.ndarray:
        return np.array([getattr(p, name) for p in params], dtype)

    host = SamplerInputs(
        temperature=col("temperature", np.float32),
        top_k=np.array([max(p.top_k, 0) for p in params], np.int32),
        top_p=col("top_p", np.float32),
        min_p=col("min_p", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        seed=seeds,
        step=steps,
        prompt_ids=prompt,
        output_ids=output,
        bias=bias,
        mask=mask,
    )
    return jax.device_put(host)  # one batched transfer, not thirteen


def _counts(ids: jax.Array, vocab: int) -> jax.Array:
    rows = jnp.arange(ids.shape[0])[:, None]
    idx = jnp.where(ids >= 0, ids, vocab)
    return jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, idx].add(1, mode="drop")


def _apply_penalties(logits: jax.Array, s: SamplerInputs) -> jax.Array:
    vocab = logits.shape[-1]
    out_counts = _counts(s.output_ids, vocab)
    seen = (out_counts + _counts(s.prompt_ids, vocab)) > 0
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


def _apply_filters(logits: jax.Array, s: SamplerInputs) -> jax.Array:
    """Top-k, then top-p over what top-k kept (renormalised), then min-p, as HF's warpers do."""
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)  # descending
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_above < s.top_p[:, None]
    # p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p); independent of normalisation.
    keep &= sorted_logits - sorted_logits[:, :1] >= jnp.log(s.min_p)[:, None]
    keep = keep.at[:, 0].set(True)
    # The smallest kept logit is the row's cutoff; ties at the cutoff are kept.
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def _apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Keep only the tokens whose bit is set; bit t of word t // 32 (xgrammar's layout)."""
    ids = jnp.arange(logits.shape[-1])
    allowed = (mask[:, ids // 32] >> (ids % 32)[None, :]) & 1
    return jnp.where(allowed.astype(bool), logits, -jnp.inf)


def first_max(x: jax.Array) -> jax.Array:
    """Index of each row's first maximum, as `jnp.argmax` gives it (a NaN counts as the maximum),
    by the kernel dispatch picks: XLA:CPU's argmax reduces value-index pairs one element at a
    time, and even its two-reduction form (`kernels_pallas.sampling.reference`) made three
    parallel passes, 4 ms of a 32-row greedy step's sampling in the engine."""
    return dispatch.first_max(x)


def _draw(key: jax.Array, logits: jax.Array) -> jax.Array:
    """`jax.random.categorical(key, logits)` for one row, by the same Gumbel-max draw."""
    return first_max(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


_STATIC = (
    "use_penalties",
    "use_filters",
    "use_random",
    "use_bias",
    "use_mask",
    "want_logprobs",
    "num_logprobs",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def sample(
    logits: jax.Array,
    s: SamplerInputs | None,
    *,
    use_penalties: bool,
    use_filters: bool,
    use_random: bool,
    use_bias: bool,
    use_mask: bool,
    want_logprobs: bool,
    num_logprobs: int,
) -> SamplerOutputs:
    """logits: [B, V] float32 -> one token per row, with logprobs when asked.

    The static flags drop whole stages no row needs: an all-greedy batch draws no random
    numbers, and no row asking for logprobs skips the log-softmax over the vocabulary.
    """
    b = logits.shape[0]
    logits = logits.astype(jnp.float32)
    raw = logits
    if use_penalties:
        logits = _apply_penalties(logits, s)
    if use_bias:
        logits = logits + s.bias
    if use_mask:
        logits = _apply_mask(logits, s.mask)
    tokens = first_max(logits)
    if use_random:
        scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
        if use_filters:
            scaled = _apply_filters(scaled, s)
        keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(
            s.seed, s.step
        )
        drawn = jax.vmap(_draw)(keys, scaled)
        tokens = jnp.where(s.temperature > 0, drawn, tokens)
    chosen = jnp.zeros((b,), jnp.float32)
    top_lp = jnp.zeros((b, 0), jnp.float32)
    top_ids = jnp.zeros((b, 0), jnp.int32)
    if want_logprobs:
        model_logprobs = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(model_logprobs, tokens[:, None], axis=-1)[:, 0]
        if num_logprobs:
            top_lp, top_ids = jax.lax.top_k(model_logprobs, num_logprobs)
    return SamplerOutputs(tokens, chosen, top_ids.astype(jnp.int32), top_lp)
