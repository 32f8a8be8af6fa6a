"""`SamplingParams`: what a request asks of the sampler, validated on the host.

`BOUNDS` is the one set of numeric limits: `SamplingParams` checks them and the HTTP request
models declare them, so the server and the engine never disagree about a range. The sampler
that applies these parameters on the device is `flipjax.runtime.sampler`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # when a request names no max_tokens, as in the OpenAI API
# Sizes a request controls, bounded so that one request cannot make the host's per-step work
# (stop matching, bias tables) unbounded. OpenAI's API allows 4 stop sequences; vLLM none.
MAX_STOP_SEQUENCES = 16
MAX_STOP_BYTES = 256
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    min_tokens: int = 0  # EOS, stop token ids and stop strings are held back until then
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit), sorted by id
    # Logprobs of every prompt token (the first has none) with this many top alternatives;
    # such a request computes its whole prompt and may ask for max_tokens=0 (scoring only).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists and dicts from callers but keep the dataclass hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in pairs)))
        _validate(self)

    @classmethod
    def greedy(cls, max_tokens: int | None = None) -> SamplingParams:
        return cls(max_tokens=max_tokens, temperature=0.0)

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def each(
        sampling: SamplingParams | list[SamplingParams] | None, prompts: list[Any]
    ) -> list[SamplingParams | None]:
        """One entry per prompt: `sampling` itself when it is a list of that length, else it
        repeated."""
        if not isinstance(sampling, list):
            return [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"sampling: {len(sampling)} SamplingParams for {len(prompts)} prompts")
        return sampling

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def uses_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class Bound:
    """The allowed range of one numeric sampling field; None is unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, ...] rather than [low, ...]

    def allows(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        return f"must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def constraints(self) -> dict[str, float]:
        """The same range as pydantic `Field` keyword arguments (ge/gt/le)."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["le"] = self.high
        return out


# The one set of limits: SamplingParams checks them, and the HTTP request models declare them.
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(0),  # 0 only with prompt logprobs (a scoring request)
    "temperature": Bound(0.0, 2.0),
    "top_k": Bound(-1),  # -1 or 0: no limit
    "top_p": Bound(0.0, 1.0, low_open=True),
    "min_p": Bound(0.0, 1.0),
    "repetition_penalty": Bound(0.0, 10.0, low_open=True),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "min_tokens": Bound(0),
}
LOGIT_BIAS = Bound(-100.0, 100.0)


def _validate(p: SamplingParams) -> None:
    for name, bound in BOUNDS.items():
        value = getattr(p, name)
        if value is not None and not bound.allows(value):
            raise ValueError(f"{name}: {bound.describe()}, got {value!r}")
    if any(not s for s in p.stop):
        raise ValueError(f"stop: stop strings must be non-empty, got {p.stop!r}")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"stop: at most {MAX_STOP_SEQUENCES} stop strings, got {len(p.stop)}")
    long = [s for s in p.stop if len(s.encode()) > MAX_STOP_BYTES]
    if long:
        raise ValueError(
            f"stop: each stop string is at most {MAX_STOP_BYTES} bytes, got {len(long[0].encode())}"
        )
    negative = [t for t in p.stop_token_ids if t < 0]
    if negative:
        raise ValueError(f"stop_token_ids: token ids must be >= 0, got {negative[:8]}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(p.logit_bias)}")
    if p.max_tokens == 0 and p.prompt_logprobs is None:
        raise ValueError("max_tokens: 0 generates nothing; it is only allowed with prompt logprobs")
    for token, value in p.logit_bias:
        if token < 0 or not LOGIT_BIAS.allows(value):
            raise ValueError(
                f"logit_bias: token {token} -> {value} ({LOGIT_BIAS.describe()}, ids >= 0)"
            )
