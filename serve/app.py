"""The OpenAI-compatible HTTP API over one engine loop that batches every client together.

`create_app` builds the server's state (`serve.state`), includes one router per route group
(`serve.routes`: completions and chat, info, admin, sessions, store) and installs the error
handlers (`serve.errors`): bad input gets a 4xx in the OpenAI error shape naming the field, and
an engine failure fails its requests with a 500 while the server keeps serving.
"""

from __future__ import annotations

from importlib.metadata import version

from fastapi import FastAPI

from flipjax.config.tree import ServeConfig
from flipjax.engine.engine import Engine
from flipjax.engine.pilot import Autopilot
from serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from serve.dispatch import Dispatcher
from serve.engine_loop import EngineLoop
from serve.errors import install_handlers
from serve.limits import BodyLimit
from serve.routes import admin, chat, completions, info, sessions
from serve.routes import store as store_routes
from serve.state import ServerState
from serve.store_control import StoreControl
from store.tiered import TieredStore


def create_app(
    engine: Engine,
    config: ServeConfig | None = None,
    *,
    chat_template: str = DEFAULT_TEMPLATE,
    store: TieredStore | None = None,
    store_control: StoreControl | None = None,
    autopilot: Autopilot | None = None,
) -> FastAPI:
    """The app serving `engine` as `config` says; `store` is the KV store behind the engine,
    which the store routes control with `store_control`."""
    config = config if config is not None else ServeConfig()
    app = FastAPI(title="flipjax", version=version("flipjax"))
    loop = EngineLoop(Dispatcher(engine, store, store_control, autopilot))
    template = ChatTemplate(chat_template)
    app.state.server = ServerState(engine.info, loop, template, config, store, store_control)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.router.on_shutdown.append(loop.close)
    install_handlers(app)
    routers = (
        info.router,
        info.guarded,
        completions.router,
        chat.router,
        sessions.router,
        admin.router,
        store_routes.router,
        store_routes.clear_router,
    )
    for router in routers:
        app.include_router(router)
    return app
