"""The engine loop takes typed messages only, and one dispatcher applies each to the engine:
an answer per message, a refusal reaches its caller alone, and the loop serves on."""

from __future__ import annotations

import threading

import pytest

from flipjax import Engine, SamplingParams
from flipjax.engine.stats import EngineStats
from serve import messages as m
from serve.dispatch import Dispatcher, Phase
from serve.engine_loop import EngineLoop
from sharding.ledger import MemoryReport


@pytest.fixture(scope="module")
def loop():
    engine = Engine.from_pretrained(
        "tiny", max_running_requests=2, max_prefill_tokens=32, num_pages=64
    )
    loop = EngineLoop(Dispatcher(engine))
    yield loop
    loop.close()


def run(loop: EngineLoop, request: m.Start) -> list[m.Update]:
    updates: list[m.Update] = []
    done = threading.Event()

    def notify(update: m.Update) -> None:
        updates.append(update)
        if update.output is not None or update.error is not None:
            done.set()

    [admitted] = loop.submit([request], notify)
    assert admitted.prompt_tokens > 0 and len(admitted.choices) == 1
    assert done.wait(120)
    return updates


def test_a_request_streams_its_tokens_then_its_output(loop):
    # Sampled, the tiny model's EOS may come first and end the request early.
    updates = run(loop, m.NewRequest([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    streamed = [t for u in updates for t in u.new_ids]
    out = updates[-1].output
    assert out is not None and len(out.token_ids) == 4
    # Updates stream what each step generated; the step that finishes answers with the output.
    assert streamed and streamed == out.token_ids[: len(streamed)]


def test_every_read_answers_with_its_type(loop):
    stats = loop.call(m.ReadStats())
    assert isinstance(stats, EngineStats) and stats.layout == "single"
    memory = loop.call(m.ReadMemory())
    assert isinstance(memory, MemoryReport) and memory.devices[0].bytes["weights"] > 0
    phase = loop.call(m.ReadPhase())
    assert isinstance(phase, Phase) and phase.policy == {"policy": "manual"}
    assert loop.call(m.FlushCache()).keys() == {"pages", "states"}
    assert loop.call(m.ReadSession("nobody")) is None
    assert loop.call(m.Abort("nobody")) is False


def test_a_flip_message_moves_the_engine_and_the_stats_see_it(loop):
    loop.call(m.Flip("tp:2"))
    stats = loop.call(m.ReadStats())
    assert stats.layout == "tp:2" and stats.flips[-1].target == "tp:2"
    loop.call(m.Flip("single"))
    assert loop.call(m.ReadStats()).layout == "single"


def test_a_refusal_reaches_its_caller_and_the_loop_serves_on(loop):
    with pytest.raises(ValueError, match="tp width 3"):
        loop.call(m.Flip("tp:3"))  # the tiny model's heads do not split three ways
    with pytest.raises(ValueError, match="prompt"):
        loop.submit([m.NewRequest([])], lambda u: None)
    with pytest.raises(ValueError, match="checkpoint"):  # this engine keeps none
        loop.submit([m.Branch("no-such-checkpoint")], lambda u: None)
    with pytest.raises(LookupError, match="without a KV store"):
        loop.call(m.ShowStore())
    assert run(loop, m.NewRequest([5, 6], SamplingParams(max_tokens=2)))[-1].output is not None


def test_the_loop_takes_no_closures(loop):
    with pytest.raises(TypeError, match="not a message"):
        loop.call(lambda engine: engine.stats())  # type: ignore[arg-type]
    assert loop.call(m.ReadStats()).running == 0
