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

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flipjax.runtime.sampling import SamplingParams
from serve.auth import State, require_api_key
from serve.messages import Branch, Checkpoint, DeleteCheckpoint, ListCheckpoints, Rewind
from serve.protocol.sessions import BranchRequest, CheckpointRequest, RewindRequest
from serve.render_completion import CompletionRenderer
from serve.streaming import sse
from serve.submission import collect, on_loop, submit

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["sessions"])

# The sampling choices a branch may override: leaving all of them out keeps the checkpoint's
# own sampling parameters and RNG state.
_SAMPLING = {f.name for f in dataclasses.fields(SamplingParams)} - {
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
}


@router.post("/session_checkpoint")
async def checkpoint(req: CheckpointRequest, state: State) -> dict[str, Any]:
    rid = req.request_id
    if rid is not None:
        rid = rid.removeprefix("chatcmpl-").removeprefix("cmpl-")
    return await on_loop(state, Checkpoint(rid, req.session_id, req.position, req.quiesce))


@router.post("/session_branch", response_model=None)
async def branch(req: BranchRequest, state: State) -> Response:
    state.check_model(req.model)
    params: SamplingParams | None = None
    if req.model_fields_set & _SAMPLING:
        params = req.sampling_params()
    branch = Branch(
        req.checkpoint_id, params, req.max_tokens, session_id=req.session_id, prompt=req.prompt
    )
    submitted = await submit(state, [branch])
    cid = f"cmpl-{submitted.choices[0].request_id}"
    renderer = CompletionRenderer(cid, state.model_name, state.info.tokenizer, None, None)
    if req.stream:
        stops = list(submitted.sampling[0].stop)
        events = sse(state, submitted, renderer, stops, req.stream_options)
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(renderer.body(submitted, await collect(state, submitted)))


@router.post("/session_rewind")
async def rewind(req: RewindRequest, state: State) -> dict[str, str]:
    await on_loop(state, Rewind(req.session_id, req.checkpoint_id))
    return {"session_id": req.session_id, "checkpoint_id": req.checkpoint_id}


@router.get("/session_checkpoints")
async def checkpoints(state: State) -> dict[str, Any]:
    return {"data": await on_loop(state, ListCheckpoints())}


@router.delete("/session_checkpoint/{checkpoint_id}")
async def delete(checkpoint_id: str, state: State) -> dict[str, str]:
    await on_loop(state, DeleteCheckpoint(checkpoint_id))
    return {"deleted": checkpoint_id}
