"""The tiny model's app under uvicorn on a loopback port, in the test's own process, so that a
test can reach into its engine (inject a fault) while real HTTP clients talk to it."""

from __future__ import annotations

import threading
import time

import uvicorn

from flipjax import Engine
from serve.app import create_app
from tests.support.servers import free_port


class InProcessServer:
    def __init__(self, log_level: str = "warning", start_s: float = 120) -> None:
        self.engine = Engine.from_pretrained("tiny", max_running_requests=4, max_prefill_tokens=32)
        self.app = create_app(self.engine)
        self.loop = self.app.state.server.loop
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level=log_level)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_s
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
