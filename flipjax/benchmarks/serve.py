"""`python -m flipjax.bench serve`: the HTTP server under concurrent clients, over loopback.

Starts `python -m flipjax.serve` (the tiny model unless `--model`), then:
1. a shared-prefix workload: `--clients` concurrent streaming clients, each sending
   `--requests` prompts made of one of a few long system prompts plus a fresh user turn;
   reports throughput, time to first token and inter-token latency (p50/p99), and where the
   prompt tokens came from (prefix hits and hit tokens per tier: device, host, disk);
2. time to first token of a `--long`-token prompt cold, then served from the device prefix
   cache, then (after `/flush_cache`) from the host tier, then, after a restart over the same
   store directory, from disk (target: a host or disk hit at least 10x faster than cold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

ADMIN_KEY = secrets.token_hex(16)  # the server it starts flushes its cache on this key only

SYSTEM_PROMPTS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: argparse.Namespace, store_dir: str, log: Any) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "flipjax.serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--store-dir",
        store_dir,
        "--gdn-checkpoint-interval",
        "64",
        "--max-prefill-tokens",
        "512",
        "--log-level",
        "warning",
        "--admin-api-key",
        ADMIN_KEY,
        *(["--disable-overlap-schedule"] if args.disable_overlap_schedule else []),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not become healthy")


async def _stream(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """One streamed completion: time to first token, gaps between chunks, usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, last, gaps, usage = None, None, [], {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if first is None:
                first = now - t0
            elif last is not None:
                gaps.append(now - last)
            last = now
            usage = chunk.get("usage") or usage
    return {"ttft": first, "gaps": gaps, "usage": usage, "seconds": time.perf_counter() - t0}


async def _workload(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    systems = [
        f"system {i}: " + "you are a careful assistant. " * (args.system_len // 28)
        for i in range(SYSTEM_PROMPTS)
    ]
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def client_loop(c: int) -> list[dict[str, Any]]:
            out = []
            for r in range(args.requests):
                prompt = f"{systems[(c + r) % SYSTEM_PROMPTS]}\nuser {c}.{r}: hello?"
                out.append(await _stream(client, args.served, prompt, args.max_tokens))
            return out

        results = await asyncio.gather(*(client_loop(c) for c in range(args.clients)))
    return [r for rs in results for r in rs]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench serve", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--system-len", type=int, default=512, help="system prompt tokens (about)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long", type=int, default=2048, help="tokens of the TTFT prompt")
    p.add_argument("--disable-overlap-schedule", action="store_true", help="passed to the server")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as folder, open(os.path.join(folder, "log"), "w") as log:
        store = os.path.join(folder, "store")
        proc, base = _start(args, store, log)
        # The name the server gives the model (the folder's name for a checkpoint).
        args.served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        try:
            asyncio.run(
                _workload(base, argparse.Namespace(**{**vars(args), "requests": 1, "clients": 1}))
            )  # warm-up
            t0 = time.perf_counter()
            results = asyncio.run(_workload(base, args))
            wall = time.perf_counter() - t0
            tiers = _prefix_hits(base)
            long_prompt = "".join(chr(97 + (i * 7) % 26) for i in range(args.long))
            cold = asyncio.run(_one(base, args.served, long_prompt))
            device = asyncio.run(_one(base, args.served, long_prompt))
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            httpx.post(f"{base}/flush_cache", headers=admin, timeout=60).raise_for_status()
            host = asyncio.run(_one(base, args.served, long_prompt))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        proc, base = _start(args, store, log)
        # The name the server gives the model (the folder's name for a checkpoint).
        args.served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        try:
            asyncio.run(_one(base, args.served, "warm up the programs " * 8))
            disk = asyncio.run(_one(base, args.served, long_prompt))
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    print(
        f"{len(results)} requests from {args.clients} clients in {wall:.1f} s: "
        f"{tokens / wall:.1f} generated tok/s, {prompt / wall:.0f} prompt tok/s"
    )
    print(
        f"TTFT p50 {_pct(ttfts, 0.5) * 1e3:.0f} ms, p99 {_pct(ttfts, 0.99) * 1e3:.0f} ms; "
        f"inter-token p50 {_pct(gaps, 0.5) * 1e3:.1f} ms, p99 {_pct(gaps, 0.99) * 1e3:.1f} ms"
    )
    share = ", ".join(f"{t} {n / prompt:.0%}" for t, n in tiers.items())
    print(
        f"prompt tokens: {cached / prompt:.0%} reused ({share}), {1 - cached / prompt:.0%} computed"
    )
    for name, r in (("device", device), ("host", host), ("disk", disk)):
        print(
            f"TTFT of a {args.long}-token prompt: cold {cold['ttft'] * 1e3:.0f} ms, from {name} "
            f"{r['ttft'] * 1e3:.0f} ms ({r['usage']['prompt_tokens_details']['cached_tokens']} "
            f"cached): {cold['ttft'] / r['ttft']:.1f}x faster (target >= 10x)"
        )
    print(f"mean e2e {statistics.mean(r['seconds'] for r in results):.2f} s per request")


def _prefix_hits(base: str) -> dict[str, float]:
    """Prompt tokens reused so far, per tier, from the server's metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith("flipjax:prefix_hit_tokens_total{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            found[tier] = float(line.rsplit(" ", 1)[1])
    return found


async def _one(base: str, model: str, prompt: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return await _stream(client, model, prompt, 4)
