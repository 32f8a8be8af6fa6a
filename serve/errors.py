"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Routes raise `APIError`; a body that fails validation (bad JSON, a wrong type or range, an
unknown field) becomes a 400 whose `param` names the field, and FastAPI's own refusals (a body
too deep to parse, an unknown route) take the same shape. Engine refusals map by their type:
ValueError is the caller's input (400), KeyError an unknown id (404). A lost process of the
cluster is a 503 for everything after it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from flipjax.engine.faults import describe_fault
from flipjax.runtime.multihost import ProcessLost
from serve.engine_loop import LoopDead


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or {400: "invalid_request_error", 404: "not_found"}.get(status, "error")


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


def refusal(err: Exception) -> APIError:
    """An engine refusal as the error the client gets; its message starts with the field."""
    message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    field = message.split(":", 1)[0]
    return APIError(404 if isinstance(err, KeyError) else 400, message, field)


def internal_error(stage: str, err: Exception) -> APIError:
    """A 500 for one request, with a reference that finds its stack in the server's log."""
    return APIError(500, describe_fault(stage, err), None, "internal_error")


def error_response(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(status_code=status, content=body)


def _field(loc: tuple[object, ...]) -> str | None:
    """The field a validation error is about: its path, without the body and without the
    union member pydantic tried (`prompt`, not `prompt.list[int]`)."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and ("[" in p or p in _TYPE_TAGS):
            break
        parts.append(str(p))
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.kind)

    @app.exception_handler(ProcessLost)
    async def process_lost(request: Request, err: ProcessLost) -> JSONResponse:
        return error_response(503, str(err), None, "service_unavailable")

    @app.exception_handler(LoopDead)
    async def loop_dead(request: Request, err: LoopDead) -> JSONResponse:
        return error_response(503, str(err), None, "service_unavailable")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        """FastAPI's own refusals in the same shape: a body it cannot parse (nested deeper than
        Python's JSON reader goes), an unknown route or method."""
        status = err.status_code
        message = f"request body: {err.detail}" if status == 400 else str(err.detail)
        kind = {400: "invalid_request_error", 404: "not_found"}.get(status, "error")
        response = error_response(status, message, None, kind)
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(
                400, "request body is not valid JSON", None, "invalid_request_error"
            )
        field = _field(first["loc"])
        return error_response(400, f"{field}: {first['msg']}", field, "invalid_request_error")
