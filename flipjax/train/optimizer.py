"""The optimizer: AdamW under a warmup-then-cosine learning rate, global-norm clipping, and
gradient accumulation over micro-batches, all optax's."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax


@dataclass(frozen=True)
class OptimizerConfig:
    steps: int  # optimizer updates the schedule spans
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    final_lr_ratio: float = 0.1  # the cosine ends at learning_rate * this
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    accumulate: int = 1  # micro-batches per update
    b1: float = 0.9
    b2: float = 0.95

    def __post_init__(self) -> None:
        checks = (
            ("steps", self.steps >= 1),
            ("learning_rate", self.learning_rate > 0),
            ("warmup_steps", self.warmup_steps >= 0),
            ("final_lr_ratio", 0 <= self.final_lr_ratio <= 1),
            ("weight_decay", self.weight_decay >= 0),
            ("clip_norm", self.clip_norm > 0),
            ("accumulate", self.accumulate >= 1),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(
                    f"--{name.replace('_', '-')}: {getattr(self, name)!r} is out of range"
                )

    def schedule(self) -> optax.Schedule:
        warmup = min(self.warmup_steps, self.steps - 1)
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=warmup,
            decay_steps=self.steps,
            end_value=self.learning_rate * self.final_lr_ratio,
        )


def _decays(params: optax.Params) -> optax.Params:
    """Weight decay on matrices only: norms, gates' biases and the GDN's per-head scalars keep
    their values (the usual AdamW practice)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    update = optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            config.schedule(),
            b1=config.b1,
            b2=config.b2,
            weight_decay=config.weight_decay,
            mask=_decays,
        ),
    )
    if config.accumulate == 1:
        return update
    return optax.MultiSteps(update, every_k_schedule=config.accumulate)
