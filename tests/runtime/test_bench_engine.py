"""The engine benchmark's bounds count the parameters a decode step uses: transformers' own
parameter names (embedding, routed experts, the rest) are the oracle. Its rates are timed within
one run, at the first token, for flipjax and transformers alike."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from flipjax import Engine, SamplingParams
from flipjax.benchmarks.engine import MOE_CONFIG, REFERENCE_CONFIG, active_parameters
from flipjax.benchmarks.run_timing import Timing, TokenTimes, interleaved, measure, output_times

SMALL = dict(hidden_size=64, num_hidden_layers=4, vocab_size=300, intermediate_size=96)
SMALL_SHAPES = dict(
    SMALL,
    layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=24,
)


def _counts(config: dict) -> tuple[int, int, int]:
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config))
    embed = experts = total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.endswith("embed_tokens.weight"):
            embed += p.numel()
        elif ".mlp.experts." in name:
            experts += p.numel()
    return total, embed, experts


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_moe_step_counts_the_experts_its_tokens_route_to(batch):
    config = dict(MOE_CONFIG, **SMALL_SHAPES, mlp_only_layers=[])
    total, embed, experts = _counts(config)
    assert experts > 0
    share = config["num_experts_per_tok"] / config["num_experts"]
    rest = total - embed - experts
    per_token = active_parameters(config, total, batch, per_token=True)
    assert per_token == pytest.approx(rest + share * experts)
    read = active_parameters(config, total, batch, per_token=False)
    assert read == pytest.approx(rest + (1 - (1 - share) ** batch) * experts)


def test_a_dense_step_counts_every_parameter_but_the_embedding():
    config = dict(REFERENCE_CONFIG, **SMALL_SHAPES, mlp_only_layers=[0, 1, 2, 3])
    total, embed, experts = _counts(config)
    assert experts == 0
    for per_token in (True, False):
        assert active_parameters(config, total, 8, per_token=per_token) == total - embed


def test_a_run_is_timed_within_itself_so_a_slow_short_run_cannot_inflate_decode():
    """Two runs whose first tokens came late in one and the rest late in the other: each rate
    is the better run's own, never a difference of two runs (which had given a decode rate
    above the weight-read bound when the machine slowed during a 1-token run)."""
    runs = iter([(2.0, 1.0), (0.5, 3.0)])
    timing = measure(lambda n: next(runs), batch=4, prompt_len=10, decode=64)
    assert timing.prefill_tok_s == pytest.approx(4 * 10 / 0.5)
    assert timing.decode_tok_s == pytest.approx(4 * 64 / 1.0)


def test_systems_take_turns_and_each_keeps_its_best_round():
    """Rounds alternate the systems, so a spell of a slower machine falls on each alike; a
    system's prefill and decode rates may come from different rounds; a peer that cannot run
    is dropped, never reported."""
    calls: list[str] = []
    rates = {
        "peer": iter([(100.0, 50.0), (80.0, 70.0)]),
        "flipjax": iter([(90.0, 40.0), (95.0, 30.0)]),
    }

    def system(name: str) -> Timing | None:
        calls.append(name)
        if name == "broken":
            return None
        prefill, decode = next(rates[name])
        return Timing(prefill, decode, 1.0)

    systems = {name: lambda name=name: system(name) for name in ("broken", "peer", "flipjax")}
    best = interleaved(systems, rounds=2)
    assert calls == ["broken", "peer", "flipjax", "peer", "flipjax"]
    assert list(best) == ["peer", "flipjax"]
    assert (best["peer"].prefill_tok_s, best["peer"].decode_tok_s) == (100.0, 70.0)
    assert (best["flipjax"].prefill_tok_s, best["flipjax"].decode_tok_s) == (95.0, 40.0)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        interleaved(systems, rounds=0)


def test_flipjax_and_transformers_runs_split_at_their_first_token():
    engine = Engine.from_pretrained("tiny", max_running_requests=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7]], sampling=params)
    first, rest = output_times(outs)
    assert 0 < first and 0 < rest
    assert first + rest == pytest.approx(max(o.e2e_s for o in outs))

    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**dict(REFERENCE_CONFIG, **SMALL_SHAPES))).eval()
    times = TokenTimes()
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(
            torch.tensor([[1, 2, 3]] * 2),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            streamer=times,
        )
    end = time.perf_counter()
    assert len(times.stamps) in (6, 7)  # the prompt too, in versions that stream it
    first, rest = times.split(start, 6)
    assert 0 < first and 0 < rest and start + first + rest <= end
    with pytest.raises(RuntimeError, match="saw .* puts for 9 tokens"):
        times.split(start, 9)
