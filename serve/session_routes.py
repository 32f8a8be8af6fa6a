"""Session checkpoint routes, guarded like the inference routes:

    POST   /session_checkpoint        {request_id | session_id, position?, quiesce?} -> summary
    POST   /session_branch            {checkpoint_id, prompt?, session_id?, ...completion
                                       params} -> a text completion (streamed or not)
    POST   /session_rewind            {session_id, checkpoint_id}: the session continues there
    GET    /session_checkpoints       every checkpoint's summary
    DELETE /session_checkpoint/{id}   unpin what it referenced

A checkpoint runs on the engine loop thread between two steps, so a quiesced request is paused
at a step boundary by construction. Refusals are 400s naming the field; unknown ids are 404s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flipjax.engine.engine import Engine
from flipjax.runtime.sampling import SamplingParams
from serve.engine_loop import EngineLoop
from serve.protocol import BranchRequest, CheckpointRequest, RewindRequest, bad_request, error
from serve.responses import text_completion

# Fields of a branch request that are not sampling choices: leaving every other one out keeps
# the checkpoint's own sampling parameters and RNG state.
_NOT_SAMPLING = {"checkpoint_id", "model", "prompt", "session_id", "max_tokens", "stream", "user"}


def add_session_routes(
    app: FastAPI,
    loop: EngineLoop,
    model: str,
    accept: Callable[[Request, type], Awaitable[Any]],
    submit: Callable[[Callable[[Engine], str]], Awaitable[Any]],
    respond: Callable[..., Awaitable[Response]],
    refusal: Callable[[Request], JSONResponse | None],
) -> None:
    async def on_loop(fn: Callable[[Engine], Any]) -> Any:
        """Run `fn` between two steps; refusals become 400 and unknown ids 404."""
        try:
            return await asyncio.to_thread(loop.call, fn)
        except KeyError as e:
            message = e.args[0] if e.args else str(e)
            return error(404, message, message.split(":", 1)[0], "not_found")
        except ValueError as e:
            return bad_request(str(e), str(e).split(":", 1)[0])

    @app.post("/session_checkpoint")
    async def checkpoint(request: Request) -> Response:
        req = await accept(request, CheckpointRequest)
        if isinstance(req, Response):
            return req
        rid = req.request_id
        if rid is not None:
            rid = rid.removeprefix("chatcmpl-").removeprefix("cmpl-")
        found = await on_loop(
            lambda e: e.checkpoint(rid, req.session_id, req.position, req.quiesce)
        )
        return found if isinstance(found, Response) else JSONResponse(found)

    @app.post("/session_branch", response_model=None)
    async def branch(request: Request) -> Response:
        req = await accept(request, BranchRequest)
        if isinstance(req, Response):
            return req
        params: SamplingParams | None = None
        if req.model_fields_set - _NOT_SAMPLING:
            params = req.sampling_params()
        used: list[SamplingParams] = []  # the branch's parameters, for the stream's stops

        def start(e: Engine) -> str:
            rid = e.branch(
                req.checkpoint_id, params, req.max_tokens, session_id=req.session_id,
                prompt=req.prompt,
            )  # fmt: skip
            used.append(e.sampling(rid))
            return rid

        submitted = await submit(start)
        if isinstance(submitted, Response):
            return submitted
        chunk, body = text_completion(f"cmpl-{submitted[0]}", model)
        return await respond(submitted, used[0], req.stream, chunk, body)

    @app.post("/session_rewind")
    async def rewind(request: Request) -> Response:
        req = await accept(request, RewindRequest)
        if isinstance(req, Response):
            return req
        done = await on_loop(lambda e: e.rewind(req.session_id, req.checkpoint_id))
        if isinstance(done, Response):
            return done
        return JSONResponse({"session_id": req.session_id, "checkpoint_id": req.checkpoint_id})

    @app.get("/session_checkpoints")
    async def checkpoints(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        listed = await on_loop(lambda e: e.list_checkpoints())
        return listed if isinstance(listed, Response) else JSONResponse({"data": listed})

    @app.delete("/session_checkpoint/{checkpoint_id}")
    async def delete(request: Request, checkpoint_id: str) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        done = await on_loop(lambda e: e.delete_checkpoint(checkpoint_id))
        if isinstance(done, Response):
            return done
        return JSONResponse({"deleted": checkpoint_id})
