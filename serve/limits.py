"""Sizes a request controls that the protocol models cannot bound alone: the body, read before it
is parsed, and the choices a request asks for, bounded by the server's flags.

A body over `--max-request-bytes` is a 413 before any of it is parsed, so a client cannot make
the server hold or parse more than that. `n` and `best_of` are bounded by `--max-n`: each choice
is a sequence on the device, and a request asking for millions would hold the engine thread.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import APIError, error_response


class BodyLimit:
    """ASGI middleware: a request whose body (declared or sent) exceeds `max_bytes` gets a 413
    naming the limit, and the application never sees it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        # Read the whole body here (the routes parse it whole anyway), counting as it arrives,
        # then replay it: a chunked body without a length is bounded the same way.
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body: larger than --max-request-bytes ({self.max_bytes} bytes)"
        response = error_response(413, message, None, "invalid_request_error")
        await response(scope, receive, send)


def check_choices(value: int, field: str, max_n: int) -> None:
    """`n` or `best_of` within the server's `--max-n`."""
    if value > max_n:
        message = f"{field}: at most {max_n} choices per request (--max-n), got {value}"
        raise APIError(400, message, field)
