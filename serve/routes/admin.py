"""Admin routes: `GET /phase` (layout, generation, last flip, the phase policy's state),
`POST /phase_flip {"to": ...}` (a flip between two engine steps; requests in flight carry
over), `POST /abort_request` and `POST /flush_cache` (the device prefix cache)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends

from serve.auth import State, require_admin
from serve.dispatch import Phase
from serve.errors import APIError, bad_request
from serve.messages import Flip, FlushCache, ReadPhase
from serve.protocol.admin import AbortRequest, FlipRequest
from serve.state import ServerState

router = APIRouter(dependencies=[Depends(require_admin)], tags=["admin"])


async def phase_state(state: ServerState) -> dict[str, Any]:
    phase: Phase = await asyncio.to_thread(state.loop.call, ReadPhase())
    stats = phase.stats
    last = stats.flips[-1] if stats.flips else None
    return {
        "layout": stats.layout,
        "generation": stats.generation,
        "last_flip": None if last is None else {**asdict(last), "direction": last.direction},
        "policy": phase.policy,
    }


@router.get("/phase")
async def phase(state: State) -> dict[str, Any]:
    return await phase_state(state)


@router.post("/phase_flip")
async def phase_flip(req: FlipRequest, state: State) -> dict[str, Any]:
    try:
        await asyncio.to_thread(state.loop.call, Flip(req.to, req.reseed))
    except ValueError as e:  # LayoutError: the layout cannot hold this model here
        raise bad_request(f"to: {e}", "to") from None
    except RuntimeError as e:  # FlipError: failed before the swap; the old layout serves
        raise APIError(500, str(e), "to", "internal_error") from None
    return await phase_state(state)


@router.post("/abort_request")
async def abort_request(req: AbortRequest, state: State) -> dict[str, str]:
    rid = req.request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
    if not await asyncio.to_thread(state.loop.cancel, rid):
        raise APIError(404, f"request_id: {req.request_id!r} is not in flight", "request_id")
    return {"aborted": req.request_id}


@router.post("/flush_cache")
async def flush_cache(state: State) -> dict[str, Any]:
    """Drop the device prefix cache; the store's host and disk tiers keep their entries."""
    flushed = await asyncio.to_thread(state.loop.call, FlushCache())
    return {"flushed": flushed}
