"""flipjax: an inference engine and server for hybrid (full attention + Gated DeltaNet) models."""

from flipjax.engine.engine import Engine, Output
from flipjax.model.config import ModelConfig
from flipjax.runtime.sampling import SamplingParams

__all__ = ["Engine", "ModelConfig", "Output", "SamplingParams"]
