"""What every route reads: the engine loop, the metrics, the chat template, the keys, and the
optional phase policy and store control, held on `app.state.server`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from flipjax.config.tree import ServeConfig
from flipjax.engine.stats import EngineInfo
from flipjax.runtime.grammar import GrammarCompiler
from serve.chat_template import ChatTemplate
from serve.engine_loop import EngineLoop
from serve.errors import APIError
from serve.metrics import Metrics
from serve.store_control import StoreControl
from store.tiered import TieredStore


@dataclass
class ServerState:
    info: EngineInfo  # the model, its tokenizer and context: fixed, read from any thread
    loop: EngineLoop  # everything else of the engine's goes through it
    template: ChatTemplate
    config: ServeConfig = field(default_factory=ServeConfig)
    store: TieredStore | None = None
    store_control: StoreControl | None = None
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: GrammarCompiler | None = None  # built on the first structured request
    grammar_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names requests may use; responses name the first."""
        return self.config.served_model_name or (self.info.name,)

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def admin_hosts(self) -> frozenset[str]:
        """Host and Origin names admin routes answer to (DNS rebinding): loopback names and
        the bind address unless configured; "*" in them: any."""
        if self.config.allowed_hosts is not None:
            return frozenset(h.lower() for h in self.config.allowed_hosts)
        return frozenset({"localhost", "127.0.0.1", "::1", self.config.host.lower()})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise APIError(404, f"model: {model!r} is not served here", "model")


def server(request: Request) -> ServerState:
    """The dependency routes declare to reach the server's state."""
    return request.app.state.server
