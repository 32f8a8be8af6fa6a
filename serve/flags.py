"""The server's flags for who may do what, and how much one request may ask: the keys, the
admin routes' hosts, the shared store's secret, and the request limits."""

from __future__ import annotations

import argparse
import os

# Light on imports: `python -m flipjax.serve --help` and the log set-up run before the server's
# modules load (a module that installs a root log handler first would silence flipjax's logs).
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # vLLM has none; 16 MiB holds any prompt the context fits
DEFAULT_MAX_N = 16  # vLLM's OpenAI server has none; OpenAI's API refuses n above 128
# vLLM has none. Schemas within the spec bounds compile in well under a second; this is for a
# compile slowed by a loaded machine or by a grammar the bounds do not catch.
DEFAULT_GRAMMAR_TIMEOUT_S = 30.0


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access and limits")
    g.add_argument("--api-key", default=None, help="Bearer key the inference routes require")
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="Bearer key for the admin routes (flips, storage backends, cache flushes); "
        "without one they are disabled",
    )
    g.add_argument(
        "--allow-insecure-admin",
        action="store_true",
        help="enable the admin routes without a key (only where every client is trusted)",
    )
    g.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Host and Origin names the admin routes answer to ('*': any; default: "
        "localhost, 127.0.0.1, ::1 and --host)",
    )
    g.add_argument(
        "--store-root",
        default=None,
        metavar="DIR",
        help="the folder every storage backend a request attaches must lie under "
        "(default: --store-dir's parent)",
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help="most choices (n, best_of) one request may ask for",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; a larger one is a 413 before it is parsed",
    )
    g.add_argument(
        "--grammar-timeout-s",
        type=float,
        default=DEFAULT_GRAMMAR_TIMEOUT_S,
        help="how long a request waits for its structured-output grammar to compile; past it "
        "the request is a 400 (the compile finishes, and is cached, on its own threads)",
    )
    g.add_argument(
        "--store-secret",
        default=os.environ.get("FLIPJAX_STORE_SECRET"),
        help="the secret (16 bytes or more) the servers sharing --remote-store sign and verify "
        "its entries with (default: $FLIPJAX_STORE_SECRET, which keeps it out of `ps`)",
    )
