"""`python -m flipjax.bench <what>`: measure flipjax against a peer in the same run.

Benchmarks: `engine` (flipjax vs transformers, prefill and decode), `store` (store tiers vs raw
file I/O), `flip` (a live layout flip vs a plain copy and vs a restart), `serve` (the HTTP
server under concurrent clients; cold vs stored-prefix TTFT), `requests` (structured output
and parallel choices against their peers), `policy` (the phase policy replayed over a mixed
trace against either static layout), `prefetch` (a stream's inter-token gaps while disk hits
are served, reading on the engine thread vs on the store's worker), `multihost` (`tp:4` over two
processes against one, and the plan broadcast's cost), `gpu` (the Pallas kernels against the
XLA references on an accelerator: kernel checks, decode, a long prefill, a flip), `matmul`
(the native small-batch matmul against XLA's dot, per weight shape and row count), `memory`
(each layout's per-device ledger and KV capacity under unequal budgets, and flip peaks), `quant`
(int8 weights against the unquantized checkpoint: logits, greedy agreement, decode speed),
`train` (a training step against transformers with torch's AdamW, and the matmul bound), `spec`
(speculative decoding with the MTP head against decoding without it: accept lengths, speed). Each
reports ratios, since a single absolute time on a shared machine means little.
"""

from __future__ import annotations

import sys

BENCHMARKS = (
    "engine",
    "store",
    "flip",
    "serve",
    "requests",
    "policy",
    "prefetch",
    "multihost",
    "gpu",
    "matmul",
    "memory",
    "quant",
    "train",
    "spec",
)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m flipjax.bench {{{','.join(BENCHMARKS)}}} [options]")
    if argv[0] == "engine":
        from flipjax.benchmarks.engine import main as run
    elif argv[0] == "flip":
        from flipjax.benchmarks.flip import main as run
    elif argv[0] == "serve":
        from flipjax.benchmarks.serve import main as run
    elif argv[0] == "requests":
        from flipjax.benchmarks.requests import main as run
    elif argv[0] == "policy":
        from flipjax.benchmarks.policy import main as run
    elif argv[0] == "prefetch":
        from flipjax.benchmarks.prefetch import main as run
    elif argv[0] == "multihost":
        from flipjax.benchmarks.multihost import main as run
    elif argv[0] == "gpu":
        from flipjax.benchmarks.gpu import main as run
    elif argv[0] == "matmul":
        from flipjax.benchmarks.matmul import main as run
    elif argv[0] == "memory":
        from flipjax.benchmarks.ledger import main as run
    elif argv[0] == "quant":
        from flipjax.benchmarks.quant import main as run
    elif argv[0] == "train":
        from flipjax.benchmarks.train import main as run
    elif argv[0] == "spec":
        from flipjax.benchmarks.spec import main as run
    else:
        from flipjax.benchmarks.store import main as run
    run(argv[1:])


if __name__ == "__main__":
    main()
