"""`python -m flipjax.bench policy`: the phase policy replayed over a mixed trace, against
staying in either layout.

A built-in trace (a burst of long prompts, then long decodes, then a steady mix) runs through a
step-level model of the engine: each step decodes every running request one token and spends a
prefill budget on queued prompts, taking rows / decode_tps + tokens / prefill_tps seconds in the
current layout; a flip stops everything for its leg. The auto run asks the real policy
(`sharding.governor.Governor` over `sharding.policy.decide`) at every step, starting in the
prefill layout as a server does. Rates come from a JSON file (for example a GPU rig's measured
prefill and decode rates and flip legs) or from calibrating the tiny model on this machine,
with the flip legs a real system measured (11.6 s into the pipeline, 6.4 s out of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from flipjax.benchmarks.cpu_devices import ask_for_cpu_devices
from sharding.governor import Governor
from sharding.policy import FlipCosts, FlipTo, PolicyConfig, Snapshot, Throughput

LEGS = {"to_prefill_s": 11.6, "to_decode_s": 6.4}


@dataclass
class Req:
    rid: str
    arrival: float
    prompt: int  # tokens still to prefill
    output: int  # tokens still to decode
    first_token: float | None = None
    done: float | None = None


def trace() -> list[Req]:
    """A burst of long prompts, then long decodes, then a steady mix, each arriving before the
    one before it is done, so the layouts' speeds decide the total."""
    reqs = [Req(f"burst-{i}", 0.0, 4096, 32) for i in range(128)]
    reqs += [Req(f"decode-{i}", 10.0, 256, 2048) for i in range(64)]
    reqs += [Req(f"mix-{i}", 40.0 + i / 2, 2048, 512) for i in range(120)]
    return reqs


def simulate(rates: dict, start: str, policy: bool, batch: int = 64, budget: int = 8192) -> dict:
    """Replay the trace; `policy` False stays in `start`. Total seconds, TTFTs and flips."""
    pre, dec = rates["prefill_layout"], rates["decode_layout"]
    tps = {k: Throughput(**v) for k, v in rates["throughput"].items()}
    legs = {dec: rates["legs"]["to_decode_s"], pre: rates["legs"]["to_prefill_s"]}
    governor = Governor(
        PolicyConfig(pre, dec, ttft_budget_s=rates.get("ttft_budget_s")),
        FlipCosts(seed_s=min(legs.values())),
    )
    reqs, now, layout, flips, running = trace(), 0.0, start, 0, []
    while any(r.done is None for r in reqs):
        arrived = [r for r in reqs if r.arrival <= now and r.done is None]
        running += [r for r in arrived if r not in running][: batch - len(running)]
        if not running:
            now = min(r.arrival for r in reqs if r.done is None)
            continue
        if policy:
            queued = sum(r.prompt for r in arrived)
            awaiting = frozenset(r.rid for r in arrived if r.first_token is None)
            waited = now - min((r.arrival for r in arrived if r.first_token is None), default=now)
            decoders = [r for r in running if r.prompt == 0]
            left = sum(min(r.output, governor.config.horizon_tokens) for r in decoders)
            snap = Snapshot(
                now, layout, queued, len(decoders), tps, waiting_s=waited, decode_tokens_left=left
            )
            choice = governor.decide(snap, awaiting)
            if isinstance(choice, FlipTo):
                now += legs[choice.layout]
                governor.flipped(layout, choice.layout, legs[choice.layout], now, awaiting)
                layout, flips = choice.layout, flips + 1
                continue
        decode = [r for r in running if r.prompt == 0]
        spent, prefill = budget, []
        for r in running:
            if r.prompt and spent:
                take = min(r.prompt, spent)
                prefill.append((r, take))
                spent -= take
        now += len(decode) / tps[layout].decode_tps + (budget - spent) / tps[layout].prefill_tps
        for r in decode:
            r.output -= 1
        for r, take in prefill:
            r.prompt -= take
            if not r.prompt:
                r.first_token, r.output = now, r.output - 1
        for r in [r for r in running if r.prompt == 0 and r.output <= 0]:
            r.done = now
            running.remove(r)
    ttft = sorted(r.first_token - r.arrival for r in reqs)
    return {
        "total_s": now,
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
        "flips": flips,
    }


def measured_rates() -> dict:
    """Prefill and decode rates of the tiny model in pp:5,3 and tp:2 on this machine."""
    ask_for_cpu_devices()
    from flipjax.engine.engine import Engine
    from flipjax.engine.pilot import Autopilot

    engine = Engine.from_pretrained(
        "tiny", layout="pp:5,3", num_pages=512, max_running_requests=8, max_prefill_tokens=256
    )
    engine.warmup()  # as a server does before it calibrates: compiles stay out of the rates
    engine.arm("tp:2")
    pilot = Autopilot(PolicyConfig("pp:5,3", "tp:2"))
    pilot.calibrate(engine, prompt_tokens=512, rows=8)
    tps = pilot.throughput()
    return {
        "prefill_layout": "pp:5,3",
        "decode_layout": "tp:2",
        "legs": LEGS,
        "throughput": {k: vars(v) for k, v in tps.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench policy", description=__doc__)
    p.add_argument(
        "--rates",
        default=None,
        help="JSON: prefill_layout, decode_layout, throughput {layout: {prefill_tps, "
        "decode_tps}}, legs {to_prefill_s, to_decode_s}, optional ttft_budget_s",
    )
    args = p.parse_args(argv)
    if args.rates:
        with open(args.rates) as f:
            rates = json.load(f)
    else:
        rates = measured_rates()
    print("rates:", json.dumps(rates))
    print(f"{'run':>12} {'total s':>9} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'flips':>6}")
    results = {
        "static " + rates["prefill_layout"]: simulate(rates, rates["prefill_layout"], False),
        "static " + rates["decode_layout"]: simulate(rates, rates["decode_layout"], False),
        "auto": simulate(rates, rates["prefill_layout"], True),
    }
    for name, r in results.items():
        print(
            f"{name:>12} {r['total_s']:>9.1f} {r['ttft_p50']:>11.2f} {r['ttft_p99']:>11.2f} "
            f"{r['flips']:>6}"
        )
    pp, tp, auto = results.values()
    print(
        f"auto total / best static = {auto['total_s'] / min(pp['total_s'], tp['total_s']):.2f}x "
        f"(target <= 1); auto TTFT p99 / static prefill layout = "
        f"{auto['ttft_p99'] / pp['ttft_p99']:.2f}x (target <= 1)"
    )
