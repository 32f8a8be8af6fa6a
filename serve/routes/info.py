"""`GET /health`, `GET /v1/models` (guarded like inference) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from flipjax.model.tiny import TINY_DESCRIPTION, TINY_NAME
from serve.auth import State, require_api_key

router = APIRouter(tags=["info"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(state: State) -> dict[str, Any]:
    engine = state.engine
    card: dict[str, Any] = {
        "id": engine.name, "object": "model", "created": state.created, "owned_by": "flipjax",
        "max_model_len": engine.max_model_len,
    }  # fmt: skip
    if engine.name == TINY_NAME:
        card["description"] = TINY_DESCRIPTION
    return {"object": "list", "data": [card]}


@router.get("/metrics")
async def prometheus(state: State) -> Response:
    await asyncio.to_thread(state.loop.call, state.metrics.read_engine)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
