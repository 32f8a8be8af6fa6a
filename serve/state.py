"""What every route reads: the engine loop, the metrics, the chat template, the keys, and the
optional phase policy and store control, held on `app.state.server`."""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass, field

from fastapi import Request

from flipjax.engine.engine import Engine
from flipjax.engine.pilot import Autopilot
from serve.chat_template import ChatTemplate
from serve.engine_loop import EngineLoop
from serve.errors import APIError
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
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(_resolve(self.host)).is_loopback

    def check_model(self, model: str | None) -> None:
        if model not in (None, self.engine.name):
            raise APIError(404, f"model: {model!r} is not served here", "model")


def server(request: Request) -> ServerState:
    """The dependency routes declare to reach the server's state."""
    return request.app.state.server


def _resolve(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)
