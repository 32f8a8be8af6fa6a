"""One model served by two processes with `jax.distributed` (gloo over loopback), two CPU
devices each: `tp:4` across both, a live flip to `pp:2,2@2,2` (one stage per process), the
store's canonical pages, a lost process and a mismatched start. Every check compares with a
single-process engine in this process. One two-process server is shared by the module, and its
last test kills process 1.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import openai
import pytest

from flipjax import Engine
from flipjax.model import orbax_io
from flipjax.model.config import ModelConfig
from store.keys import files_fingerprint
from store.open import open_store
from tests.support.hf_oracle import make_checkpoint
from tests.support.http import HTTP
from tests.support.servers import ROOT, free_port, wait_healthy
from tests.support.tokenizers import byte_tokenizer

HEARTBEAT_S = 3  # the served cluster's, so that a lost process is noticed quickly
START_HEARTBEAT_S = 10  # the rest: a loaded machine must not make a process look lost
PAGE, GRID = 16, 32
DEVICE_COUNT = "--xla_force_host_platform_device_count"
ENGINE = dict(max_running_requests=4, max_prefill_tokens=64, num_pages=64, page_size=PAGE)
FLAGS = (
    "--max-running-requests",
    "4",
    "--max-prefill-tokens",
    "64",
    "--num-pages",
    "64",
    "--page-size",
    str(PAGE),
    "--gdn-checkpoint-interval",
    str(GRID),
    "--no-warmup",
    "--served-model-name",
    "m",
    "--allow-insecure-admin",
)
PROMPTS = [[(7 * i + j) % 256 for j in range(11 + 5 * i)] for i in range(3)]
LONG = [(3 * j + 1) % 256 for j in range(90)]  # pages and GDN states for the store
EARLIER = [(5 * j + 2) % 256 for j in range(70)]  # published by one process, before the cluster


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Heads that four devices split: KV heads too, so a store page is gathered from both."""
    folder = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(
        str(folder),
        seed=11,
        vocab_size=256,
        num_key_value_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
    )
    byte_tokenizer(str(folder / "tokenizer.json"))
    return str(folder)


def two_devices(xla_flags: str) -> str:
    """The session's XLA flags (its cheaper compiles, its rendezvous bound) with two devices."""
    kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT)]
    return " ".join([*kept, f"{DEVICE_COUNT}=2"])


def launch(
    log_dir,
    checkpoint: str,
    *flags: str,
    per_process=None,
    command=("flipjax.serve", "--model"),
    heartbeat_s: int = START_HEARTBEAT_S,
) -> list[subprocess.Popen]:
    """Two processes of one cluster, each with two CPU devices; `per_process(i)` adds flags."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": two_devices(os.environ["XLA_FLAGS"])}
    procs = []
    for i in range(2):
        extra = per_process(i) if per_process else ()
        cmd = [
            sys.executable,
            "-m",
            *command,
            checkpoint,
            *flags,
            *extra,
            "--coordinator-address",
            coordinator,
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            "--heartbeat-timeout-s",
            str(heartbeat_s),
        ]
        with open(log_dir / f"process{i}.txt", "w") as log:
            procs.append(
                subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


def exit_codes(procs: list[subprocess.Popen], log_dir, timeout_s: float = 180) -> list[int]:
    """Each process's exit code; a process still running after `timeout_s` is killed, and the
    failure carries every process's log, since a hang shows only there."""
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0)) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        logs = "\n".join(
            f"--- process {i} ---\n" + (log_dir / f"process{i}.txt").read_text()
            for i in range(len(procs))
        )
        pytest.fail(f"a process was still running after {timeout_s:.0f} s:\n{logs}")


def store_of(checkpoint: str, folder) -> object:
    """A store over `folder`, with the identity the server derives from its flags."""
    cfg = ModelConfig.from_hf(checkpoint)
    bridge, _ = open_store(
        cfg, files_fingerprint(checkpoint), "float32", PAGE, GRID, 2**28, str(folder), 2**30
    )
    return bridge


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster")
    # Before the cluster starts, one process publishes a prefix into the store it will open.
    bridge = store_of(checkpoint, logs / "store")
    single = Engine.from_pretrained(checkpoint, prefix_store=bridge, **ENGINE)
    single.generate([EARLIER], max_new_tokens=6)
    bridge.store.flush()
    bridge.store.close()
    del single
    port = free_port()
    procs = launch(
        logs,
        checkpoint,
        "--layout",
        "tp:4",
        "--port",
        str(port),
        "--store-dir",
        str(logs / "store"),
        *FLAGS,
        heartbeat_s=HEARTBEAT_S,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(procs[0], base, str(logs / "process0.txt"))
        yield procs, base, logs
    finally:
        procs[0].send_signal(signal.SIGTERM)  # process 1 returns when process 0 stops
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def reference(checkpoint) -> Engine:
    return Engine.from_pretrained(checkpoint, layout="single", **ENGINE)


def complete(base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = HTTP.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_process_tp4_gives_the_single_process_tokens(cluster, reference):
    _, base, logs = cluster
    want = [o.token_ids for o in reference.generate(PROMPTS, max_new_tokens=10)]
    got = [complete(base, p, 10)["choices"][0]["token_ids"] for p in PROMPTS]
    assert got == want
    follower = (logs / "process1.txt").read_text()
    assert "following process 0 (layout tp:4)" in follower


def test_a_prefix_published_by_the_cluster_is_a_hit_for_one_process(cluster, checkpoint, tmp_path):
    _, base, logs = cluster
    served = complete(base, LONG, 6)["choices"][0]["token_ids"]
    route = f"{base}/hicache/storage-backend"
    last, deadline = -1, time.monotonic() + 60
    while time.monotonic() < deadline:  # the disk tier's writes land on its worker
        used = HTTP.get(route, timeout=30).json()["disk"]["used_bytes"]
        if used > 0 and used == last:
            break
        last = used
        time.sleep(0.5)
    # A copy: the cluster's store stays its own.
    shutil.copytree(logs / "store", tmp_path / "store")
    bridge = store_of(checkpoint, tmp_path / "store")
    engine = Engine.from_pretrained(
        checkpoint, layout="tp:2", prefix_store=bridge, prefetch_wait_s=30.0, **ENGINE
    )
    out = engine.generate([LONG], max_new_tokens=6)[0]
    prefix = engine.stats().prefix
    assert prefix.get("hits_disk", 0) == 1
    assert prefix.get("hit_tokens_disk", 0) == 64  # two 32-token GDN anchors of 90
    assert out.token_ids == served

    # And the reverse: a prefix one process published before the cluster started.
    earlier = complete(base, EARLIER, 6)
    assert earlier["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    want = engine.generate([EARLIER], max_new_tokens=6)[0].token_ids
    assert earlier["choices"][0]["token_ids"] == want

    # The cluster seeds its sharded pages and states from its host tier too.
    assert HTTP.post(f"{base}/flush_cache", timeout=60).status_code == 200
    again = complete(base, LONG, 6)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert again["choices"][0]["token_ids"] == served


def test_a_live_flip_to_one_stage_per_process_is_token_identical(cluster, reference):
    _, base, _ = cluster
    want = reference.generate(PROMPTS, max_new_tokens=40)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300)
    texts: list[list[str]] = [[] for _ in PROMPTS]
    started = threading.Barrier(len(PROMPTS) + 1)

    def stream(i: int) -> None:
        first = True
        for chunk in client.completions.create(
            model="m", prompt=PROMPTS[i], max_tokens=40, temperature=0, stream=True
        ):
            texts[i].append(chunk.choices[0].text)
            if first:
                first = False
                started.wait()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    started.wait(timeout=300)  # every stream is decoding
    r = HTTP.post(f"{base}/phase_flip", json={"to": "pp:2,2@2,2"}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["layout"] == "pp:2,2@2,2"
    for t in threads:
        t.join(timeout=300)
    assert ["".join(t) for t in texts] == [o.text for o in want]
    flip = r.json()["last_flip"]
    assert flip["live_pages"] > 0  # requests were in flight
    after = complete(base, PROMPTS[0], 10)["choices"][0]["token_ids"]
    assert after == want[0].token_ids[:10]


def test_a_lost_process_is_reported_within_the_heartbeat(cluster):
    procs, base, _ = cluster
    procs[1].kill()
    t0 = time.monotonic()
    while True:
        r = HTTP.get(f"{base}/health", timeout=10)
        if r.status_code == 503:
            break
        assert time.monotonic() - t0 < 3 * HEARTBEAT_S + 5, "no 503 within the bound"
        time.sleep(0.2)
    assert "process 1 of the cluster lost" in r.json()["error"]
    assert r.json()["lost_processes"] == [1]
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 4}
    refused = HTTP.post(f"{base}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 503 and "process 1" in refused.json()["error"]["message"]
    assert procs[0].poll() is None  # process 0 stays up to say so


def test_a_mismatched_start_is_refused_naming_the_difference(checkpoint, tmp_path):
    procs = launch(
        tmp_path,
        checkpoint,
        "--layout",
        "tp:4",
        "--store-dir",
        "none",
        *FLAGS,
        per_process=lambda i: ("--num-pages", "64" if i == 0 else "32"),
    )
    codes = exit_codes(procs, tmp_path)
    assert codes[0] != 0 and codes[1] != 0
    for i in range(2):
        text = (tmp_path / f"process{i}.txt").read_text()
        assert "process 1 was started with num_pages=32, but process 0 with num_pages=64" in text


def test_an_orbax_checkpoint_restores_each_process_its_own_shards(checkpoint, tmp_path):
    orbax = str(tmp_path / "orbax")
    orbax_io.convert(checkpoint, orbax, jnp.float32, progress=False)
    procs = launch(tmp_path, orbax, "--layout", "tp:4", command=("flipjax.ckpt", "restore"))
    assert exit_codes(procs, tmp_path) == [0, 0]
    held = []
    for i in range(2):
        text = (tmp_path / f"process{i}.txt").read_text()
        m = re.search(rf"process {i} of 2: .* hold ([0-9.]+) MiB of the ([0-9.]+) MiB", text)
        assert m, text
        for sign in ("Traceback", "could not see the others leave"):
            assert sign not in text, f"process {i} did not leave cleanly:\n{text}"
        held.append((float(m.group(1)), float(m.group(2))))
    (a, total), (b, _) = held
    assert a < 0.75 * total and b < 0.75 * total  # split heads: neither holds the whole model
