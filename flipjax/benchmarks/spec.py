"""`python -m flipjax.bench spec`: speculative decoding with the checkpoint's MTP head against
decoding without it, in one run, on the shipped model (`flipjax-py`, whose head was trained
beside it) unless `--model` names another folder with `mtp.*` tensors.

Prompts are function headers from the training corpus's held-out text (the standard library's
tests, as `python -m flipjax.train.report` picks them), continued greedily.

- Accept length for each K in `--num-steps`: the tokens a request takes per verify step
  (drafts kept + the model's own), its mean and histogram, and per draft position the share
  of drafts the model agreed with, over `--prompts` prompts and `--tokens` tokens each.
- Decode tok/s at each batch size and each K in `--speed-steps`: speculation off, on in every
  step, the same with the head in the model's dtype, and adaptive (the default: each batch
  size takes the way measured faster here), each timed as `bench engine` times it (n tokens'
  time less one token's, the best of `--repeats`), all of a batch size's engines interleaved.
  The accept lengths' tokens are compared with decoding without drafts, and a difference is
  reported, never averaged away.

The head drafts with `--draft-quantization` weights (`--speculative-draft-model-quantization`;
default int8: its drafts only propose) everywhere but the column that says otherwise.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from flipjax.benchmarks.run_timing import timed
from flipjax.config.speculative import DRAFT_QUANTIZATIONS
from flipjax.train import corpus
from flipjax.train.report import held_out_signatures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench spec", description=__doc__)
    p.add_argument("--model", default="flipjax-py")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-steps", default="1,2,3,4")
    p.add_argument("--speed-steps", default="3,4")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--draft-quantization", default="int8", choices=DRAFT_QUANTIZATIONS)
    args = p.parse_args(argv)
    prompts = [s.text for s in held_out_signatures(corpus.load().held_out, args.prompts)]
    print(
        f"model {args.model} ({args.dtype}), {len(prompts)} held-out function headers, draft "
        f"head {args.draft_quantization}"
    )
    plain = _engine(args, 0, len(prompts))
    want = [o.token_ids for o in plain.generate(prompts, max_new_tokens=args.tokens)]
    del plain
    print("\nK  mean accept length  histogram (tokens per step: rows)  agreement per position")
    for k in (int(x) for x in args.num_steps.split(",")):
        engine = _engine(args, k, len(prompts))
        ids = [o.token_ids for o in engine.generate(prompts, max_new_tokens=args.tokens)]
        s = engine.stats().speculative
        rates = " ".join(
            f"{a / d:.2f}" if d else "-" for a, d in zip(s.accepted_at, s.drafted_at, strict=True)
        )
        same = "same tokens" if ids == want else "TOKENS DIFFER from decoding without drafts"
        print(f"{k}  {s.mean_accept_length:.2f}  {dict(s.accept_lengths)}  {rates}  ({same})")
    speeds = [int(x) for x in args.speed_steps.split(",")]
    print(f"\ndecode tok/s, speculation K = {args.speed_steps}")
    print(
        "batch  K  off  on (ratio)  on, head unquantized (ratio)  adaptive (ratio, steps without "
        "drafts)  prefill tok/s off, on"
    )
    float_head = argparse.Namespace(**{**vars(args), "draft_quantization": "unquant"})
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        rows = (prompts * batch)[:batch]
        ways = {("off", 0): _engine(args, 0, batch, warm=True)}
        for k in speeds:
            for way, a, adaptive in (
                ("on", args, False),
                ("unquant", float_head, False),
                ("adaptive", args, True),
            ):
                ways[(way, k)] = _engine(a, k, batch, adaptive, warm=True)
        # Interleaved, best of `--repeats` each: this machine's speed drifts within a minute.
        best: dict[tuple[str, int], list[float]] = {way: [float("inf")] * 2 for way in ways}
        for engine in ways.values():
            _generate(engine, rows, args.decode_tokens + 1)  # compiles, and the policy measures
        for _ in range(args.repeats):
            for way, engine in ways.items():
                for i, n in enumerate((1, args.decode_tokens + 1)):
                    run = functools.partial(_generate, engine, rows, n)
                    best[way][i] = min(best[way][i], timed(run))
        rate = {w: batch * args.decode_tokens / (t[1] - t[0]) for w, t in best.items()}
        prompt_len = sum(len(ways["off", 0].info.tokenizer.encode(r)) for r in rows) / batch
        prefill = {w: batch * prompt_len / t[0] for w, t in best.items()}
        off = rate["off", 0]
        for k in speeds:
            s = ways["adaptive", k].stats().speculative
            plain = s.plain_steps / max(s.plain_steps + s.verify_rows // batch, 1)
            on, auto, unquant = (rate[w, k] for w in ("on", "adaptive", "unquant"))
            print(
                f"{batch}  {k}  {off:.1f}  {on:.1f} ({on / off:.2f}x)  {unquant:.1f} "
                f"({unquant / off:.2f}x)  {auto:.1f} ({auto / off:.2f}x, {plain:.0%})  "
                f"{prefill['off', 0]:.0f}, {prefill['on', k]:.0f}"
            )


def _generate(engine: Any, rows: list[str], tokens: int) -> None:
    engine.generate(rows, max_new_tokens=tokens)


def _engine(
    args: argparse.Namespace, steps: int, rows: int, adaptive: bool = False, warm: bool = False
) -> Any:
    from flipjax import Engine

    spec: dict[str, Any] = {}
    if steps:
        spec = dict(
            speculative_algorithm="MTP",
            speculative_num_steps=steps,
            speculative_adaptive=adaptive,
            speculative_draft_model_quantization=args.draft_quantization,
        )
    engine = Engine.from_pretrained(
        args.model,
        dtype=args.dtype,
        max_running_requests=max(rows, 1),
        max_prefill_tokens=512,  # headers are short: one chunk each
        num_pages=512,
        **spec,
    )
    if warm:
        engine.warmup()  # every step shape: no compile inside a timed run
    return engine
