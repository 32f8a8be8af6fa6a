"""`python -m flipjax.serve`: start the OpenAI-compatible HTTP server.

A thin entry point: the flags are generated from the config tree (`flipjax.config`), and the
server itself lives in `serve/`, imported inside `main()`, so the `flipjax` package never
depends on it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any

from flipjax.config.cli import parse
from flipjax.config.tree import FlipjaxConfig


def parse_args(argv: list[str] | None = None) -> FlipjaxConfig:
    return parse(argv, "python -m flipjax.serve", __doc__)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    sc = config.serve
    logging.basicConfig(level=sc.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    import uvicorn

    from flipjax.engine.engine import Engine
    from flipjax.runtime import multihost
    from serve.app import create_app

    log = logging.getLogger("flipjax.serve")
    dc = config.distributed
    # Before anything else touches a device.
    cluster = multihost.initialize(
        dc.coordinator_address, dc.num_processes, dc.process_id, dc.heartbeat_timeout_s
    )
    # Every flag but the process's own rank and log level must agree across the cluster.
    multihost.agree(_shared_facts(config))
    log.info("config: %s", config.facts())
    if not cluster.leader:
        _follow(Engine.from_pretrained(config.model.model, config), log)
        return
    bridge, book, control = _open_store(config, log)
    engine = Engine.from_pretrained(
        config.model.model, config, prefix_store=bridge, checkpoints=book
    )
    cfg = engine.info.model
    log.info(
        "model %s: %d layers (%d full attention, %d GDN), hidden %d, vocab %d, dtype %s",
        engine.info.name,
        cfg.num_hidden_layers,
        len(cfg.full_attention_layers),
        len(cfg.linear_attention_layers),
        cfg.hidden_size,
        cfg.vocab_size,
        config.model.dtype,
    )
    stats = engine.stats()
    log.info("layout %s on %d device(s)", stats.layout, stats.devices)
    if config.layout.warmup:
        t0 = time.perf_counter()
        engine.warmup()
        compiles = engine.stats().compiles
        log.info("warm-up: %d programs in %.1f s", compiles, time.perf_counter() - t0)
    for layout in engine.info.config.layout.arm:  # --layout auto may have chosen them
        engine.arm(layout)
        log.info("armed layout %s", layout)
    log.info("%s", engine.memory().table())
    autopilot = _autopilot(config, engine, log)
    from flipjax.model.shipped import resolve
    from serve.chat_template import load_template

    model = config.model.model
    template = load_template(None if model == "tiny" else resolve(model))
    _log_pools(engine, log)
    if sc.served_model_name is None:  # responses name the model as it was given
        sc = dataclasses.replace(sc, served_model_name=(config.model.model,))
    app = create_app(
        engine,
        sc,
        chat_template=template,
        store=bridge.store,
        store_control=control,
        autopilot=autopilot,
    )
    if sc.admin_api_key is None and not sc.allow_insecure_admin:
        log.info("admin routes: disabled (no --admin-api-key)")
    loop = app.state.server.loop
    # A dead engine loop ends the server (uvicorn stops on SIGTERM), and the exit code says so.
    loop.on_death = lambda _: os.kill(os.getpid(), signal.SIGTERM)
    uvicorn.run(app, host=sc.host, port=sc.port, log_level=sc.log_level)
    if loop.dead is not None:
        raise SystemExit(f"the engine loop stopped: {loop.dead}")


def _shared_facts(config: FlipjaxConfig) -> dict[str, Any]:
    facts = config.facts()
    for local in ("process_id", "log_level"):
        facts.pop(local)
    return facts


def _log_pools(engine: Any, log: logging.Logger) -> None:
    stats, ec = engine.stats(), engine.info.config.engine
    log.info(
        "pools: %d KV pages of %d tokens, %d GDN slots; at most %d running requests",
        stats.pools["pages_total"],
        ec.page_size,
        stats.pools["slots_total"],
        ec.max_running_requests,
    )
    states, grid = stats.prefix_cache_states, stats.gdn_interval
    cache = f"device radix tree, up to {states} GDN states on a {grid}-token grid"
    log.info("prefix cache: %s", cache if states else "off")


def _follow(engine: Any, log: logging.Logger) -> None:
    """A process other than 0: run process 0's device operations until it stops."""
    from flipjax.runtime.multihost import ProcessLost

    log.info("following process 0 (layout %s); process 0 serves HTTP", engine.stats().layout)
    try:
        ran = engine.follow()
    except ProcessLost as err:
        log.error("cluster: %s; exiting", err)
        raise SystemExit(1) from err
    log.info("process 0 stopped; followed %d device operations", ran)


def _autopilot(config: FlipjaxConfig, engine: Any, log: logging.Logger) -> Any:
    """The automatic phase policy, calibrated in both layouts; None when manual."""
    lc = engine.info.config.layout  # as settled: --layout auto chooses the decode layout
    if lc.phase_policy == "manual":
        return None
    from flipjax.engine.pilot import Autopilot
    from sharding.policy import PolicyConfig

    prefill = engine.stats().layout
    policy = PolicyConfig(
        prefill_layout=prefill, decode_layout=lc.arm[0], ttft_budget_s=lc.ttft_budget_s
    )
    autopilot = Autopilot(policy)
    t0 = time.perf_counter()
    autopilot.calibrate(engine)
    measured = autopilot.throughput().items()
    rates = {k: (round(v.prefill_tps), round(v.decode_tps)) for k, v in measured}
    log.info(
        "phase policy auto: prefill in %s, decode in %s; calibrated in %.1f s, "
        "(prefill, decode) tokens/s %s",
        prefill,
        lc.arm[0],
        time.perf_counter() - t0,
        rates,
    )
    return autopilot


def _open_store(config: FlipjaxConfig, log: logging.Logger) -> tuple[Any, Any, Any]:
    """The KV store behind the engine, keyed by the model's config, weights and KV dtype."""
    from flipjax.engine.assembly import page_dtype
    from flipjax.engine.loader import model_fingerprint
    from flipjax.model.config import ModelConfig
    from flipjax.model.shipped import resolve
    from flipjax.model.tiny import TINY_NAME, tiny_config
    from flipjax.runtime.hybrid import default_interval
    from serve.store_control import StoreControl
    from store.open import disk_folder, open_checkpoints, open_store

    model, st = config.model.model, config.store
    cfg = tiny_config() if model == TINY_NAME else ModelConfig.from_hf(resolve(model))
    weights_id = model_fingerprint(model)  # what the engine's cluster agrees on, too
    if config.model.quantization is not None:
        # Weights quantized at load compute other KV than the files' own: another model.
        weights_id += f"+{config.model.quantization}"
    page_size = config.engine.page_size
    grid = config.cache.gdn_checkpoint_interval or default_interval(page_size)
    remote_url, secret = st.remote_store, st.store_secret
    if remote_url and not secret:
        log.warning(
            "store: the shared tier %s is off: without --store-secret (or FLIPJAX_STORE_SECRET) "
            "its entries can be neither signed nor verified",
            remote_url,
        )
        remote_url = None
    min_free = int(st.disk_min_free_gb * 2**30)
    bridge, identity = open_store(
        cfg,
        weights_id,
        config.model.dtype,
        page_size,
        grid,
        int(st.host_cache_gb * 2**30),
        st.store_dir,
        int(st.disk_cache_gb * 2**30),
        remote_url,
        min_free,
        secret.encode() if secret else None,
        page_dtype(config),
    )
    where = "off" if st.store_dir is None else disk_folder(st.store_dir, identity)
    remote = bridge.store.remote
    remote_state = "up" if remote is not None and remote.available else "down"
    log.info(
        "store: host %.1f GiB, disk %s (%.1f GiB, %.1f GiB kept free), remote %s, GDN state "
        "every %d tokens",
        st.host_cache_gb,
        where,
        st.disk_cache_gb,
        st.disk_min_free_gb,
        "off" if remote is None else f"{remote.url} ({remote_state})",
        grid,
    )
    book = open_checkpoints(bridge, identity, st.store_dir)
    log.info(
        "session checkpoints: %d loaded from %s", len(book.list()), book.folder or "memory only"
    )
    root = st.store_root or (None if st.store_dir is None else os.path.dirname(st.store_dir))
    folder = None if st.store_dir is None else where
    control = StoreControl(identity.digest(), folder, min_free, root)
    return bridge, book, control


if __name__ == "__main__":
    main()
