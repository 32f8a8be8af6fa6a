"""`python -m flipjax.serve`: start the OpenAI-compatible HTTP server.

A thin entry point: the server itself lives in `serve/` and is imported inside `main()`, so the
`flipjax` package never depends on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flipjax.serve", description=__doc__)
    p.add_argument("--model", default="tiny", help="HF checkpoint folder, or 'tiny' (default)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names requests may use; responses carry the first (default: --model as given)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3"],
        default=None,
        help="split <think>...</think> out of chat answers into reasoning_content",
    )
    p.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="structured JSON output without free whitespace between tokens",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--layout",
        default=None,
        help="where the state lives: single (default), tp, tp:N, pp:L1,L2,...[@W1,...]",
    )
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="LAYOUT",
        help="compile a layout's programs at start, so a flip to it compiles nothing",
    )
    p.add_argument(
        "--phase-policy",
        default="manual",
        choices=["manual", "auto"],
        help="auto: flip by measured throughput between --layout (the prefill "
        "layout) and the one --arm layout (the decode layout)",
    )
    p.add_argument(
        "--ttft-budget-s",
        type=float,
        default=None,
        help="auto policy: a ceiling on queued prompts' time to first token it "
        "respects when it weighs a flip",
    )
    p.add_argument(
        "--flip-memory-headroom",
        type=float,
        default=None,
        metavar="GIB",
        help="GiB a flip may add per device on devices without memory_stats "
        "(the CPU); a flip that needs more is refused",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip compiling every step shape at start (serving then compiles on "
        "first use of each shape)",
    )
    from serve.flags import add_access_arguments

    add_access_arguments(p)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=1024, help="KV pages in the device pool")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="take each decode step's tokens in before dispatching the next (by default a "
        "steady decode batch runs one step ahead of the host; the tokens are the same)",
    )
    p.add_argument(
        "--store-dir",
        default="~/.cache/flipjax/store",
        help="disk tier of the KV store ('none': host RAM only)",
    )
    p.add_argument("--host-cache-gb", type=float, default=4.0)
    p.add_argument("--disk-cache-gb", type=float, default=32.0)
    p.add_argument(
        "--disk-min-free-gb",
        type=float,
        default=0.0,
        help="free space the disk tier leaves on its file system, evicting to keep it",
    )
    p.add_argument(
        "--remote-store",
        default=None,
        metavar="redis://HOST:PORT/DB",
        help="a Redis server that servers of this model share, beneath host and disk; "
        "its entries are signed with --store-secret, without which it is not used",
    )
    p.add_argument(
        "--prefetch-wait-ms",
        type=float,
        default=100.0,
        help="how long a queued request may wait for its stored prefix to reach host "
        "memory before it computes (0: never; running requests step on meanwhile)",
    )
    p.add_argument(
        "--gdn-checkpoint-interval",
        type=int,
        default=None,
        help="tokens between stored GDN states, a multiple of the page size "
        "(default: the page multiple nearest at or above 256)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    from flipjax.runtime import multihost

    multihost.add_arguments(p)
    args = p.parse_args(argv)
    if args.phase_policy == "auto" and len(args.arm) != 1:
        p.error(
            f"--phase-policy auto needs exactly one --arm layout (the decode layout), "
            f"got {len(args.arm)}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    import uvicorn

    from flipjax.engine.engine import Engine
    from flipjax.runtime import multihost
    from serve.app import create_app

    log = logging.getLogger("flipjax.serve")
    cluster = multihost.initialize_from(args)  # before anything else touches a device
    local = ("process_id", "log_level")  # the only flags that may differ between processes
    multihost.agree({k: v for k, v in vars(args).items() if k not in local})
    if not cluster.leader:
        _follow(Engine.from_pretrained(args.model, **_engine_options(args)), log)
        return
    bridge, book, control = _open_store(args, log)
    engine = Engine.from_pretrained(
        args.model, prefix_store=bridge, checkpoints=book, **_engine_options(args)
    )
    cfg = engine.config
    log.info(
        "model %s: %d layers (%d full attention, %d GDN), hidden %d, vocab %d, dtype %s",
        engine.name, cfg.num_hidden_layers, len(cfg.full_attention_layers),
        len(cfg.linear_attention_layers), cfg.hidden_size, cfg.vocab_size, args.dtype,
    )  # fmt: skip
    devices = len(engine.runner.binding.placement.devices)
    log.info("layout %s on %d device(s)", engine.layout, devices)
    if not args.no_warmup:
        t0 = time.perf_counter()
        engine.warmup()
        log.info("warm-up: %d programs in %.1f s", engine.compile_count, time.perf_counter() - t0)
    for layout in args.arm:
        engine.arm(layout)
        log.info("armed layout %s", layout)
    autopilot = _autopilot(args, engine, log)
    from serve.chat_template import load_template

    template = load_template(None if args.model == "tiny" else args.model)
    log.info(
        "pools: %d KV pages of %d tokens, %d GDN slots; at most %d running requests",
        engine.pages.total, args.page_size, engine.slots.total, args.max_running_requests,
    )  # fmt: skip
    cache = engine.prefix_cache
    log.info(
        "prefix cache: %s", "off" if cache is None else
        f"device radix tree, up to {cache.max_states} GDN states on a {cache.interval}-token grid",
    )  # fmt: skip
    app = create_app(
        engine, args.host, args.api_key, args.admin_api_key, template, control, autopilot,
        args.served_model_name or [args.model], args.reasoning_parser,
        not args.disable_any_whitespace, max_n=args.max_n, max_request_bytes=args.max_request_bytes,
        allow_insecure_admin=args.allow_insecure_admin, allowed_hosts=args.allowed_hosts,
        grammar_timeout_s=args.grammar_timeout_s,
    )  # fmt: skip
    if args.admin_api_key is None and not args.allow_insecure_admin:
        log.info("admin routes: disabled (no --admin-api-key)")
    loop = app.state.server.loop
    # A dead engine loop ends the server (uvicorn stops on SIGTERM), and the exit code says so.
    loop.on_death = lambda _: os.kill(os.getpid(), signal.SIGTERM)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    if loop.dead is not None:
        raise SystemExit(f"the engine loop stopped: {loop.dead}")


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dtype=args.dtype, layout=args.layout, page_size=args.page_size, num_pages=args.num_pages,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens, prefetch_wait_s=args.prefetch_wait_ms / 1e3,
        overlap=not args.disable_overlap_schedule,
        flip_memory_headroom=None if args.flip_memory_headroom is None
        else int(args.flip_memory_headroom * 2**30),
    )  # fmt: skip


def _follow(engine: Any, log: logging.Logger) -> None:
    """A process other than 0: run process 0's device operations until it stops."""
    from flipjax.runtime.multihost import ProcessLost

    log.info("following process 0 (layout %s); process 0 serves HTTP", engine.layout)
    try:
        ran = engine.follow()
    except ProcessLost as err:
        log.error("cluster: %s; exiting", err)
        raise SystemExit(1) from err
    log.info("process 0 stopped; followed %d device operations", ran)


def _autopilot(args: argparse.Namespace, engine: Any, log: logging.Logger) -> Any:
    """The automatic phase policy, calibrated in both layouts; None when manual."""
    if args.phase_policy == "manual":
        return None
    from flipjax.engine.pilot import Autopilot
    from sharding.policy import PolicyConfig

    autopilot = Autopilot(PolicyConfig(
        prefill_layout=engine.layout, decode_layout=args.arm[0], ttft_budget_s=args.ttft_budget_s
    ))  # fmt: skip
    t0 = time.perf_counter()
    autopilot.calibrate(engine)
    measured = autopilot.throughput().items()
    rates = {k: (round(v.prefill_tps), round(v.decode_tps)) for k, v in measured}
    log.info(
        "phase policy auto: prefill in %s, decode in %s; calibrated in %.1f s, "
        "(prefill, decode) tokens/s %s", engine.layout, args.arm[0],
        time.perf_counter() - t0, rates,
    )  # fmt: skip
    return autopilot


def _open_store(args: argparse.Namespace, log: logging.Logger) -> tuple[Any, Any, Any]:
    """The KV store behind the engine, keyed by the model's config, weights and KV dtype."""
    from flipjax.model.config import ModelConfig
    from flipjax.model.tiny import TINY_NAME, TINY_SEED, tiny_config
    from flipjax.runtime.hybrid import default_interval
    from serve.store_control import StoreControl
    from store.keys import files_fingerprint
    from store.open import disk_folder, open_checkpoints, open_store

    if args.model == TINY_NAME:
        cfg, weights_id = tiny_config(), f"tiny-seed-{TINY_SEED}"
    else:
        cfg, weights_id = ModelConfig.from_hf(args.model), files_fingerprint(args.model)
    store_dir = None if args.store_dir == "none" else args.store_dir
    grid = args.gdn_checkpoint_interval or default_interval(args.page_size)
    remote_url, secret = args.remote_store, args.store_secret
    if remote_url and not secret:
        log.warning(
            "store: the shared tier %s is off: without --store-secret (or FLIPJAX_STORE_SECRET) "
            "its entries can be neither signed nor verified", remote_url,
        )  # fmt: skip
        remote_url = None
    bridge, identity = open_store(
        cfg, weights_id, args.dtype, args.page_size, grid,
        int(args.host_cache_gb * 2**30), store_dir, int(args.disk_cache_gb * 2**30),
        remote_url, int(args.disk_min_free_gb * 2**30), secret.encode() if secret else None,
    )  # fmt: skip
    where = "off" if store_dir is None else disk_folder(store_dir, identity)
    remote = bridge.store.remote
    log.info(
        "store: host %.1f GiB, disk %s (%.1f GiB, %.1f GiB kept free), remote %s, GDN state "
        "every %d tokens", args.host_cache_gb, where, args.disk_cache_gb, args.disk_min_free_gb,
        "off" if remote is None else f"{remote.url} ({'up' if remote.available else 'down'})",
        grid,
    )  # fmt: skip
    book = open_checkpoints(bridge, identity, store_dir)
    log.info(
        "session checkpoints: %d loaded from %s", len(book.list()), book.folder or "memory only"
    )
    root = args.store_root or (None if store_dir is None else os.path.dirname(store_dir))
    control = StoreControl(
        identity.digest(), None if store_dir is None else where,
        int(args.disk_min_free_gb * 2**30), root,
    )  # fmt: skip
    return bridge, book, control


if __name__ == "__main__":
    main()
