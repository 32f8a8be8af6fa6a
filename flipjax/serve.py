"""`python -m flipjax.serve`: start the OpenAI-compatible HTTP server.

A thin entry point: the server itself lives in `serve/` and is imported inside `main()`, so the
`flipjax` package never depends on it.
"""

from __future__ import annotations

import argparse
import logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flipjax.serve", description=__doc__)
    p.add_argument("--model", default="tiny", help="HF checkpoint folder, or 'tiny' (default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--layout", default=None,
                   help="where the state lives: single (default), tp, tp:N, pp:L1,L2,...[@W1,...]")
    p.add_argument("--arm", action="append", default=[], metavar="LAYOUT",
                   help="compile a layout's programs at start, so a flip to it compiles nothing")
    p.add_argument("--api-key", default=None, help="Bearer key the inference routes require")
    p.add_argument("--admin-api-key", default=None,
                   help="Bearer key for phase routes (without one they answer on loopback only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    import uvicorn

    from flipjax.engine import Engine
    from serve.api import create_app

    log = logging.getLogger("flipjax.serve")
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, layout=args.layout)
    cfg = engine.config
    log.info(
        "model %s: %d layers (%d full attention, %d GDN), hidden %d, vocab %d, dtype %s",
        engine.name, cfg.num_hidden_layers, len(cfg.full_attention_layers),
        len(cfg.linear_attention_layers), cfg.hidden_size, cfg.vocab_size, args.dtype,
    )  # fmt: skip
    devices = len(engine.runner.binding.placement.devices)
    log.info("layout %s on %d device(s)", engine.layout, devices)
    for layout in args.arm:
        engine.arm(layout)
        log.info("armed layout %s", layout)
    from serve.chat import load_template

    template = load_template(None if args.model == "tiny" else args.model)
    app = create_app(engine, args.host, args.api_key, args.admin_api_key, template)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
