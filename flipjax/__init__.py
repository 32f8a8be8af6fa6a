"""flipjax: an inference engine and server for hybrid (full attention + Gated DeltaNet) models.

The public face is `Engine`, `FlipjaxConfig`, `SamplingParams`, `Output` and `ModelConfig`.
They load on first use (PEP 562): importing a lower layer, such as `flipjax.model.config` from
the store or a CLI, must not drag in the engine and every layer above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
