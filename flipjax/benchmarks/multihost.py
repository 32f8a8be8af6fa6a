"""`python -m flipjax.bench multihost`: `tp:4` over two processes against `tp:4` in one.

One random model (written once as an orbax checkpoint, which each process of the cluster
restores reading only its shards) decodes a batch greedily in two setups, in the same run:
one process with four CPU devices, and a cluster of two processes with two devices each over
gloo on loopback, process 0 announcing every device operation (`flipjax.runtime.mirror`). It
reports decode tokens/s of each and their ratio, and what the plan broadcast costs: per
announcement, per decode step, and as a share of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

MODEL = dict(
    vocab_size=4096,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=1536,
)
OPTIONS = dict(num_pages=256, max_prefill_tokens=64)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench multihost", description=__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a checkpoint folder
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return _worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model")
        subprocess.run([sys.executable, "-c", _WRITE, ckpt], check=True, env=_env(1))
        one = _run([_cmd(args, ckpt)], devices=4)[0]
        coordinator = f"127.0.0.1:{_free_port()}"
        two = _run([_cmd(args, ckpt, coordinator, i) for i in range(2)], devices=2)[0]
    print(
        f"tp:4, batch {args.batch}, {args.decode_tokens} greedy tokens after "
        f"{args.prompt_len}-token prompts"
    )
    for name, r in (("1 process x 4 devices", one), ("2 processes x 2 devices", two)):
        print(f"  {name:<24} decode {r['decode_tps']:8.1f} tok/s  step {r['step_ms']:6.1f} ms")
    print(f"  ratio 2-process / 1-process decode: {two['decode_tps'] / one['decode_tps']:.2f}x")
    per = two["broadcast_ms"] / max(two["announcements"], 1)
    print(
        f"  plan broadcast: {per:.2f} ms per announcement ({two['announcements']} sent, "
        f"{two['bytes'] / max(two['announcements'], 1):.0f} B each, "
        f"{two['extra_frames']} needed a second frame); "
        f"{two['broadcast_decode_ms']:.2f} ms per decode step, "
        f"{100 * two['broadcast_decode_ms'] / two['step_ms']:.0f}% of it"
    )


_WRITE = """
import dataclasses, sys
import jax.numpy as jnp
from flax import nnx
from flipjax.benchmarks.multihost import MODEL
from flipjax.model import orbax_io
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.tiny import tiny_config
cfg = dataclasses.replace(tiny_config(), **MODEL)
_, params = nnx.split(Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
orbax_io.save(sys.argv[1], params, cfg, jnp.float32, copy_from=None)
"""


def _env(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _cmd(
    args: argparse.Namespace,
    ckpt: str,
    coordinator: str | None = None,
    process_id: int | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "flipjax.benchmarks.multihost",
        "--worker",
        ckpt,
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--decode-tokens",
        str(args.decode_tokens),
    ]
    if coordinator is not None:
        cmd += ["--coordinator", coordinator, "--process-id", str(process_id)]
    return cmd


def _run(cmds: list[list[str]], devices: int) -> list[dict]:
    procs = [subprocess.Popen(c, env=_env(devices), stdout=subprocess.PIPE) for c in cmds]
    outs = [proc.communicate(timeout=1800)[0] for proc in procs]
    for proc in procs:
        if proc.returncode:
            raise SystemExit(f"a benchmark process failed with exit code {proc.returncode}")
    return [json.loads(out.decode().strip().splitlines()[-1]) for out in outs[:1]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(args: argparse.Namespace) -> None:
    from flipjax.config.tree import DistributedConfig
    from flipjax.engine.engine import Engine  # after the cluster is joined
    from flipjax.runtime import mirror, multihost

    if args.coordinator is not None:
        heartbeat = DistributedConfig().heartbeat_timeout_s
        multihost.initialize(args.coordinator, 2, args.process_id, heartbeat)
    engine = Engine.from_pretrained(
        args.worker, layout="tp:4", max_running_requests=args.batch, **OPTIONS
    )
    if not multihost.current().leader:
        engine.follow()
        return
    engine.warmup()
    prompts = [[(17 * i + j) % 4000 + 1 for j in range(args.prompt_len)] for i in range(args.batch)]
    engine.generate(prompts, max_new_tokens=4)  # compile what warm-up leaves
    chan = mirror.channel()
    sent0 = dict(chan.counters) if chan else {}
    secs0 = chan.seconds if chan else 0.0
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=args.decode_tokens)
    decode_s = decode_tokens = decode_steps = 0
    broadcast_decode = 0.0
    while engine.has_unfinished():
        before = chan.seconds if chan else 0.0
        engine.step()
        stats = engine.last_step
        if stats.decode_rows and not stats.prefill_tokens:
            decode_s += stats.seconds
            decode_tokens += stats.decode_rows
            decode_steps += 1
            broadcast_decode += (chan.seconds if chan else 0.0) - before
    result = dict(
        decode_tps=decode_tokens / decode_s,
        step_ms=1e3 * decode_s / decode_steps,
        broadcast_decode_ms=1e3 * broadcast_decode / decode_steps,
        broadcast_ms=1e3 * ((chan.seconds if chan else 0.0) - secs0),
        announcements=(chan.counters["sent"] - sent0.get("sent", 0)) if chan else 0,
        bytes=(chan.counters["bytes"] - sent0.get("bytes", 0)) if chan else 0,
        extra_frames=(chan.counters["extra_frames"] - sent0.get("extra_frames", 0)) if chan else 0,
    )
    mirror.stop()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
