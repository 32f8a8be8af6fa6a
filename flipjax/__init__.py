"""flipjax: an inference engine and server for hybrid (full attention + Gated DeltaNet) models."""

from flipjax.config import ModelConfig
from flipjax.engine import Engine, Output
from flipjax.sampling import SamplingParams

__all__ = ["Engine", "ModelConfig", "Output", "SamplingParams"]
