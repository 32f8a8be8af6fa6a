"""What every route reads: the engine loop, the metrics, the chat template, the keys, and the
optional phase policy and store control, held on `app.state.server`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from flipjax.engine.engine import Engine
from flipjax.engine.pilot import Autopilot
from flipjax.runtime.grammar import GrammarCompiler
from serve.chat_template import ChatTemplate
from serve.engine_loop import EngineLoop
from serve.errors import APIError
from serve.flags import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_N
from serve.metrics import Metrics
from serve.store_control import StoreControl


@dataclass
class ServerState:
    engine: Engine
    loop: EngineLoop
    template: ChatTemplate
    host: str = "127.0.0.1"
    api_key: str | None = None
    admin_key: str | None = None
    store_control: StoreControl | None = None
    autopilot: Autopilot | None = None
    served_names: list[str] = field(default_factory=list)  # responses name the first
    reasoning_parser: str | None = None  # "qwen3": <think>...</think> into reasoning_content
    any_whitespace: bool = True  # JSON grammars allow any whitespace between tokens
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: GrammarCompiler | None = None  # built on the first structured request
    grammar_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S  # a request waits this for its compile
    max_n: int = DEFAULT_MAX_N  # choices per request (n, best_of)
    # Admin routes without an admin key: refused unless the operator opts in.
    allow_insecure_admin: bool = False
    # Host and Origin names admin routes answer to (DNS rebinding); None: loopback names and
    # the bind address; "*" in it: any.
    allowed_hosts: frozenset[str] | None = None

    def __post_init__(self) -> None:
        self.served_names = self.served_names or [self.engine.name]

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def admin_hosts(self) -> frozenset[str]:
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        return frozenset({"localhost", "127.0.0.1", "::1", self.host.lower()})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise APIError(404, f"model: {model!r} is not served here", "model")


def server(request: Request) -> ServerState:
    """The dependency routes declare to reach the server's state."""
    return request.app.state.server
