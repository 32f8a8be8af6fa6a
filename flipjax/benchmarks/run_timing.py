"""How the benchmarks time a batch run: prefill and decode rates from one run each, split at
the batch's first token. flipjax's outputs carry the times (`output_times`); transformers'
first token is noted by a streamer (`TokenTimes`). Timing a 1-token and a 65-token run apart
and taking the difference, as `bench engine` once did, made a slowdown of the machine during
the short run into a decode rate above the weight-read bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flipjax.benchmarks.memory import PeakRSS
from flipjax.engine.outputs import Output


@dataclass
class Timing:
    prefill_tok_s: float
    decode_tok_s: float
    peak_mb: float


def measure(
    run: Callable[[int], tuple[float, float]],
    batch: int,
    prompt_len: int,
    decode: int,
    runs: int = 2,
) -> Timing:
    """run(n) generates n tokens for the whole batch and returns the seconds to its first token
    and from there to its last; each the best of `runs` runs."""
    if runs < 1:
        raise ValueError(f"measure: runs must be at least 1, got {runs}")
    with PeakRSS() as mem:
        times = [run(decode + 1) for _ in range(runs)]
    prefill_s = min(first for first, _ in times)
    decode_s = min(rest for _, rest in times)
    return Timing(batch * prompt_len / prefill_s, batch * decode / decode_s, mem.peak_delta / 2**20)


def interleaved(systems: dict[str, Callable[[], Timing | None]], rounds: int) -> dict[str, Timing]:
    """Each system's best prefill and decode rates over `rounds` rounds in which every system
    runs once in turn: a machine that slows for a while then slows a round of each, not all of
    one system's runs. A system whose run gives None (a peer that cannot run) is dropped."""
    if rounds < 1:
        raise ValueError(f"interleaved: rounds must be at least 1, got {rounds}")
    seen: dict[str, list[Timing]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, run in systems.items():
            if name in seen and (timing := run()) is not None:
                seen[name].append(timing)
            else:
                seen.pop(name, None)
    return {
        name: Timing(
            max(t.prefill_tok_s for t in ts),
            max(t.decode_tok_s for t in ts),
            max(t.peak_mb for t in ts),
        )
        for name, ts in seen.items()
    }


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def output_times(outs: Sequence[Output]) -> tuple[float, float]:
    """flipjax's outputs of one batch run: seconds to the batch's first token (the prompts
    arrive together and prefill in one step), and from there to its last token."""
    first = max(o.ttft_s or 0.0 for o in outs)
    return first, max(o.e2e_s for o in outs) - first


class TokenTimes:
    """A transformers streamer that notes when each `put` arrives: the prompt (in the versions
    that stream it), then one per generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: object) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def split(self, start: float, tokens: int) -> tuple[float, float]:
        """Seconds from `start` to the first of the last `tokens` puts, and from there on."""
        if len(self.stamps) < tokens:
            raise RuntimeError(f"the streamer saw {len(self.stamps)} puts for {tokens} tokens")
        first = self.stamps[-tokens]
        return first - start, self.stamps[-1] - first
