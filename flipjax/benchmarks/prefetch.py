"""`python -m flipjax.bench prefetch`: what a disk hit costs the other streams, with the store
read on the engine thread (the former behaviour) and with it read by the store's worker.

A stream decodes on the tiny model while, every few steps, another request arrives whose
~4k-token prompt is stored on disk (published by an earlier engine, the page cache dropped so
the read comes from the device). The stream's inter-token gaps are recorded around each hit;
reported per mode are their p50, p99 and maximum, and the ratio of the p99s. Both modes run in
the same process over the same store folder, on fresh engines and host tiers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax.numpy as jnp
import numpy as np

GRID = 64  # GDN states every 64 tokens: the stored prefix of a 4064-token prompt is 4032


def _drop_page_cache(folder: str) -> None:
    """Let the kernel forget the segment files' cached pages (they are durable): a hit reads
    the device, as it would on a server that has not touched them lately."""
    os.sync()
    for d, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flipjax.bench prefetch", description=__doc__)
    p.add_argument("--hits", type=int, default=6, help="disk hits per mode")
    p.add_argument("--prompt-len", type=int, default=4064)
    p.add_argument("--every", type=int, default=12, help="stream steps between two hits")
    p.add_argument("--dir", default=None, help="where the store lives (default: a temp folder)")
    args = p.parse_args(argv)

    from flipjax import Engine, SamplingParams
    from flipjax.config.tree import FlipjaxConfig
    from flipjax.model.tiny import TINY_SEED, tiny_config, tiny_model
    from flipjax.model.tokenizer import ByteTokenizer
    from store.open import open_store

    model = tiny_model(jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(args.hits + 1)]
    config = FlipjaxConfig.build(
        page_size=16,
        num_pages=2 * args.prompt_len // 16 + 64,
        max_running_requests=4,
        max_prefill_tokens=2048,
        gdn_checkpoint_interval=GRID,
    )

    def engine(folder: str, sync_reads: bool) -> tuple[Engine, object]:
        tiny = tiny_config(), f"tiny-seed-{TINY_SEED}"
        bridge, _ = open_store(*tiny, "float32", 16, GRID, 1 << 30, folder, 4 << 30)
        bridge.sync_reads = sync_reads
        engine = Engine(model, ByteTokenizer(), config, name="tiny", prefix_store=bridge)
        return engine, bridge

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        writer, bridge = engine(folder, sync_reads=False)
        writer.generate(prompts, max_new_tokens=1)  # every prompt's prefix goes to disk
        bridge.store.close()

        rows = []
        for mode, sync_reads in (("on the engine thread", True), ("by the store's worker", False)):
            eng, bridge = engine(folder, sync_reads)
            eng.warmup()
            eng.generate([prompts[-1]], max_new_tokens=2)  # compiles the seeding path
            _drop_page_cache(folder)
            gaps, seeded = _stream_through_hits(
                eng, prompts[: args.hits], args.every, SamplingParams
            )
            bridge.store.close()
            rows.append((mode, gaps, seeded))

    print(
        f"a stream's inter-token gaps (ms) around {args.hits} disk hits of "
        f"{rows[0][2] // args.hits} tokens each; tiny model, fp32"
    )
    print(f"{'store read':<22} {'p50':>7} {'p99':>7} {'max':>7} {'hit tokens':>11}")
    for mode, gaps, seeded in rows:
        q = np.percentile(gaps, [50, 99])
        print(f"{mode:<22} {q[0]:>7.1f} {q[1]:>7.1f} {max(gaps):>7.1f} {seeded:>11}")
    p99 = [float(np.percentile(g, 99)) for _, g, _ in rows]
    print(
        f"p99 worker / engine thread: {p99[1] / p99[0]:.2f}x "
        f"(median gap {statistics.median(rows[1][1]) / statistics.median(rows[0][1]):.2f}x)"
    )


def _stream_through_hits(engine, prompts: list[list[int]], every: int, SamplingParams):
    """Step a decoding stream, adding one stored prompt every `every` steps; returns the
    stream's gaps between tokens (ms) and the prompt tokens the hits seeded."""
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    stream = engine.add_request([1, 2, 3], params)
    for _ in range(4):  # past its prefill
        engine.step()
    gaps, seeded, pending, running = [], 0, list(prompts), 0
    last, made, steps = time.perf_counter(), len(engine.progress(stream).new_ids), 0
    while pending or running:
        if pending and steps % every == 0:
            engine.add_request(pending.pop(0), SamplingParams(temperature=0, max_tokens=1))
            running += 1
        for out in engine.step():
            seeded += out.cached_tokens
            running -= 1
        steps += 1
        now = time.perf_counter()
        generated = len(engine.progress(stream).new_ids)
        if generated > made:
            gaps.append((now - last) * 1e3)
            last, made = now, generated
    engine.abort(stream)
    return gaps, seeded
