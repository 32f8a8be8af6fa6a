"""The training loop: micro-batches through the compiled step, a progress bar, held-out
evaluation, checkpoints, and the stops (the last step, an interrupt, a non-finite loss)."""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from flipjax.train.batches import Batches, DataPosition
from flipjax.train.checkpoints import TrainCheckpoints
from flipjax.train.step import EvalSums, Trainer


class TrainingDiverged(FloatingPointError):
    """A step's loss or gradients were not finite; the message names the step and the batch."""


@dataclass(frozen=True)
class Evaluation:
    loss: float  # nats per token
    bits_per_byte: float
    mtp_loss: float
    mtp_agreement: float  # MTP's greedy t+2 equal to the model's

    def line(self, update: int) -> str:
        return (
            f"step {update}: held-out loss {self.loss:.4f}, {self.bits_per_byte:.4f} bits/byte, "
            f"MTP loss {self.mtp_loss:.4f}, MTP agrees with the model on "
            f"{self.mtp_agreement:.1%} of t+2 tokens"
        )


def evaluate(
    trainer: Trainer, params: Any, sequences: np.ndarray, byte_lengths: np.ndarray, batch: int
) -> Evaluation:
    """Sums over `sequences` in batches of `batch` rows (a last partial batch is left out)."""
    total = EvalSums(0.0, 0, 0.0, 0, 0)
    for first in range(0, len(sequences) - batch + 1, batch):
        sums = trainer.evaluate(params, trainer.batch(sequences[first : first + batch]))
        total = EvalSums(*(a + b for a, b in zip(total, sums, strict=True)))
    if total.tokens == 0:
        raise ValueError("held-out text: too short for one evaluation batch")
    used = sequences[: (len(sequences) // batch) * batch]
    text_bytes = int(byte_lengths[used[:, 1:]].sum())
    return Evaluation(
        loss=total.nats / total.tokens,
        bits_per_byte=total.nats / (math.log(2) * max(text_bytes, 1)),
        mtp_loss=total.mtp_nats / max(total.mtp_tokens, 1),
        mtp_agreement=total.mtp_agree / max(total.mtp_tokens, 1),
    )


class Interrupts:
    """SIGINT and SIGTERM ask the loop to stop after its current step (and save); a second
    SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class LoopSettings:
    updates: int
    accumulate: int
    save_every: int
    eval_every: int
    progress: bool = True


def train(
    trainer: Trainer,
    params: Any,
    opt_state: Any,
    batches: Batches,
    position: DataPosition,
    start: int,
    settings: LoopSettings,
    checkpoints: TrainCheckpoints,
    evaluation: Callable[[Any], Evaluation] | None,
) -> tuple[Any, Any, int, str | None]:
    """Micro-steps from `start` to `updates * accumulate`; returns the parameters, optimizer
    state, the micro-step reached and the signal that stopped the run early (None: done)."""
    total = settings.updates * settings.accumulate
    tokens_per_step = batches.batch * batches.sequences.shape[1]
    bar = tqdm(total=total, initial=start, disable=not settings.progress, unit="step")
    step = start
    with Interrupts() as interrupts:
        while step < total and interrupts.requested is None:
            rows, after = batches.draw(position)
            began = time.perf_counter()
            params, opt_state, metrics = trainer.step(params, opt_state, trainer.batch(rows))
            loss, finite = float(metrics.losses.next_token), bool(metrics.finite)
            if not finite:
                raise TrainingDiverged(
                    f"step {step + 1}: the loss is {float(metrics.losses.total)} and the gradient "
                    f"norm {float(metrics.grad_norm)} on the batch at epoch {position.epoch}, "
                    f"sequences {position.index}..{position.index + batches.batch - 1}; "
                    "no checkpoint was written"
                )
            step, position = step + 1, after
            rate = tokens_per_step / (time.perf_counter() - began)
            bar.set_postfix(
                loss=f"{loss:.3f}", mtp=f"{float(metrics.losses.mtp):.3f}", tok_s=f"{rate:,.0f}"
            )
            bar.update()
            update, boundary = divmod(step, settings.accumulate)
            if boundary == 0 and evaluation is not None and update % settings.eval_every == 0:
                bar.write(evaluation(params).line(update), file=sys.stderr)
            if boundary == 0 and (update % settings.save_every == 0 or step == total):
                checkpoints.save(step, params, opt_state, position)
        if interrupts.requested is not None and checkpoints.latest_step() != step:
            checkpoints.save(step, params, opt_state, position)
    bar.close()
    return params, opt_state, step, interrupts.requested
