"""The OpenAI-compatible HTTP API over one engine loop that batches every client together.

`create_app` builds the server's state (`serve.state`), includes one router per route group
(`serve.routes`: completions and chat, info, admin, sessions, store) and installs the error
handlers (`serve.errors`): bad input gets a 4xx in the OpenAI error shape naming the field, and
an engine failure fails its requests with a 500 while the server keeps serving.
"""

from __future__ import annotations

from importlib.metadata import version

from fastapi import FastAPI

from flipjax.engine.engine import Engine
from flipjax.engine.pilot import Autopilot
from serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from serve.engine_loop import EngineLoop
from serve.errors import install_handlers
from serve.flags import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES
from serve.limits import BodyLimit
from serve.routes import admin, chat, completions, info, sessions, store
from serve.state import ServerState
from serve.store_control import StoreControl


def create_app(
    engine: Engine,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    admin_key: str | None = None,
    chat_template: str = DEFAULT_TEMPLATE,
    store_control: StoreControl | None = None,
    autopilot: Autopilot | None = None,
    served_names: list[str] | None = None,
    reasoning_parser: str | None = None,
    any_whitespace: bool = True,
    *,
    max_n: int = DEFAULT_MAX_N,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allow_insecure_admin: bool = False,
    allowed_hosts: list[str] | None = None,
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
) -> FastAPI:
    app = FastAPI(title="flipjax", version=version("flipjax"))
    loop = EngineLoop(engine, autopilot)
    app.state.server = ServerState(
        engine, loop, ChatTemplate(chat_template), host, api_key, admin_key, store_control,
        autopilot, served_names or [], reasoning_parser, any_whitespace,
    )  # fmt: skip
    state = app.state.server
    state.max_n, state.allow_insecure_admin = max_n, allow_insecure_admin
    state.grammar_timeout_s = grammar_timeout_s
    if allowed_hosts is not None:
        state.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.router.on_shutdown.append(loop.close)
    install_handlers(app)
    for router in (info.router, info.guarded, completions.router, chat.router, sessions.router,
                   admin.router, store.router, store.clear_router):  # fmt: skip
        app.include_router(router)
    return app
