"""flipjax: an inference engine and server for hybrid (full attention + Gated DeltaNet) models.

The public face is `Engine`, `FlipjaxConfig`, `SamplingParams`, `Output` and `ModelConfig`.
They load on first use (PEP 562): importing a lower layer, such as `flipjax.model.config` from
the store or a CLI, must not drag in the engine and every layer above it.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# A bf16 row must round the same in every program that computes it, such as a decode step and
# a speculative verify step. By default XLA may keep a bf16 value in f32 within a fusion
# ("excess precision"), so where it rounds depends on how the program was fused, and a verify
# step's logits differed from decoding's at every position (by up to 0.03 in logprob; greedy
# runs parted after tens of tokens). XLA reads its flags when its first backend starts: set
# here unless the process chose this flag itself. It costs nothing measurable in float32
# (nothing to round) and no decode rate in bf16 (README, speculative decoding).
_EXACT_BF16 = "--xla_allow_excess_precision=false"
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_EXACT_BF16}".strip()

if TYPE_CHECKING:
    from flipjax.config.tree import FlipjaxConfig
    from flipjax.engine.engine import Engine
    from flipjax.engine.outputs import Output
    from flipjax.model.config import ModelConfig
    from flipjax.runtime.sampling import SamplingParams

_PUBLIC = {
    "Engine": "flipjax.engine.engine",
    "FlipjaxConfig": "flipjax.config.tree",
    "Output": "flipjax.engine.outputs",
    "ModelConfig": "flipjax.model.config",
    "SamplingParams": "flipjax.runtime.sampling",
}
__all__ = ["Engine", "FlipjaxConfig", "ModelConfig", "Output", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'flipjax' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
