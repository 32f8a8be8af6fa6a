"""Speculative decoding: sglang's flags and vLLM's JSON form of the same two settings.

`--speculative-algorithm MTP --speculative-num-steps K` (sglang) and `--speculative-config
'{"method": "mtp", "num_speculative_tokens": K}'` (vLLM) both settle into `algorithm` and
`num_steps`; asking for both ways at once with different answers is refused, naming both.
The draft head's weights follow the model's quantization unless
`--speculative-draft-model-quantization` (sglang; vLLM's `"quantization"`) says otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from flipjax.config.option import option
from flipjax.model.config import QUANTIZATIONS

ALGORITHMS = ("MTP",)
MAX_NUM_STEPS = 4  # the head is applied K times; drafts past four rarely survive
DEFAULT_NUM_STEPS = 3
_VLLM_METHODS = {"mtp": "MTP", "qwen3_next_mtp": "MTP"}
_VLLM_KEYS = {"method", "num_speculative_tokens", "quantization"}
UNQUANTIZED = "unquant"  # sglang's word for a draft in the model's dtype under a quantized model
DRAFT_QUANTIZATIONS = (*QUANTIZATIONS, UNQUANTIZED)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Drafting tokens with the checkpoint's MTP head and verifying them in one step."""

    speculative_algorithm: str | None = option(
        None,
        "draft tokens with the checkpoint's multi-token-prediction head (mtp.*) and verify "
        "them in one step; the tokens are the model's own either way",
        choices=ALGORITHMS,
    )
    speculative_num_steps: int | None = option(
        None,
        f"drafts per step, 1 to {MAX_NUM_STEPS} (default {DEFAULT_NUM_STEPS} with an algorithm)",
    )
    speculative_adaptive: bool = option(
        True,
        "speculate in every decode step, even where this machine measures it slower than "
        "decoding without drafts (by default each batch size takes the faster way)",
        flag="--disable-speculative-adaptive",
        negate=True,
    )
    speculative_draft_model_quantization: str | None = option(
        None,
        "the draft head's weights: int8 (weight-only, its lm head too) or unquant (the "
        "model's dtype); default: as the model is quantized. Drafts only propose, so this "
        "changes speed and acceptance, never a token",
        choices=DRAFT_QUANTIZATIONS,
    )
    speculative_config: str | None = option(
        None,
        'vLLM\'s form: \'{"method": "mtp", "num_speculative_tokens": K}\'',
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        algorithm, steps = self.speculative_algorithm, self.speculative_num_steps
        quantization = self.speculative_draft_model_quantization
        if self.speculative_config is not None:
            method, tokens, theirs_q = _parse_vllm(self.speculative_config)
            for name, mine, theirs in (
                ("speculative_algorithm", algorithm, method),
                ("speculative_num_steps", steps, tokens),
                ("speculative_draft_model_quantization", quantization, theirs_q),
            ):
                if mine is not None and theirs is not None and mine != theirs:
                    raise ValueError(
                        f"{name}: {mine!r} disagrees with speculative_config's {theirs!r}"
                    )
            algorithm, steps, quantization = method, tokens, quantization or theirs_q
        if quantization is not None and quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"speculative_draft_model_quantization: {quantization!r} is not supported; "
                f"use one of {DRAFT_QUANTIZATIONS}"
            )
        if algorithm is None and quantization is not None:
            raise ValueError(
                "speculative_draft_model_quantization: given without speculative_algorithm"
            )
        if algorithm is not None and algorithm.upper() not in ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm: {algorithm!r} is not supported; use one of {ALGORITHMS}"
            )
        if algorithm is None and steps is not None:
            raise ValueError("speculative_num_steps: given without speculative_algorithm")
        if algorithm is not None:
            algorithm = algorithm.upper()
            steps = DEFAULT_NUM_STEPS if steps is None else steps
            if isinstance(steps, bool) or not isinstance(steps, int):
                raise ValueError(f"speculative_num_steps: must be an integer, got {steps!r}")
            if not 1 <= steps <= MAX_NUM_STEPS:
                raise ValueError(
                    f"speculative_num_steps: {steps} is out of range [1, {MAX_NUM_STEPS}]"
                )
        object.__setattr__(self, "speculative_algorithm", algorithm)
        object.__setattr__(self, "speculative_num_steps", steps)
        object.__setattr__(self, "speculative_draft_model_quantization", quantization)

    @property
    def draft_tokens(self) -> int:
        """Drafts a verify step checks per row (K); 0 without speculation."""
        return self.speculative_num_steps or 0

    def draft_quantization(self, model_quantization: str | None) -> str | None:
        """How the draft head's weights are quantized under a model quantized by
        `model_quantization` (None: in the model's dtype)."""
        chosen = self.speculative_draft_model_quantization
        if chosen is None:
            return model_quantization
        return None if chosen == UNQUANTIZED else chosen


def _parse_vllm(text: str) -> tuple[str, int, str | None]:
    """vLLM's `--speculative-config` -> (algorithm, drafts per step, draft quantization)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config: not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative_config: must be a JSON object")
    unknown = sorted(set(raw) - _VLLM_KEYS)
    if unknown:
        raise ValueError(f"speculative_config: {unknown[0]!r} is not supported here")
    method = raw.get("method")
    if method not in _VLLM_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported; use one of "
            f"{sorted(_VLLM_METHODS)}"
        )
    tokens = raw.get("num_speculative_tokens", DEFAULT_NUM_STEPS)
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ValueError(
            f"speculative_config: num_speculative_tokens must be an integer, got {tokens!r}"
        )
    quantization = raw.get("quantization")
    if quantization is not None and quantization not in DRAFT_QUANTIZATIONS:
        raise ValueError(
            f"speculative_config: quantization {quantization!r} is not supported; use one of "
            f"{DRAFT_QUANTIZATIONS}"
        )
    return _VLLM_METHODS[method], tokens, quantization
