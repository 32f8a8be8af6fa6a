"""Store control routes (admin): look at, attach, detach and resize the disk tier while serving.

    GET    /hicache/storage-backend          tiers, budgets and counters
    PUT    /hicache/storage-backend          {"disk_gb": 8, "dir"?: path}: attach a disk tier
    DELETE /hicache/storage-backend          detach (queued writes land first; files stay)
    POST   /hicache/storage-backend/resize   {"disk_gb": 2}: shrinking evicts at once
    POST   /hicache/clear                    {"remote"?: true}: drop the stored prefixes

Every change runs on the engine loop thread between two steps, so no step sees half of it;
a clear too, save its remote part, which runs beside the loop. A clear keeps what session
checkpoints pin (and says how much) and leaves the device prefix cache (`/flush_cache`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends

from serve.auth import State, require_admin
from serve.errors import APIError, bad_request
from serve.messages import (
    AttachStore,
    ClearStore,
    DetachStore,
    Message,
    ResizeStore,
    ShowStore,
)
from serve.protocol.admin import AttachRequest, ClearRequest, ResizeRequest
from serve.state import ServerState
from serve.store_control import StoreControl
from store.tiered import TieredStore

ROUTE = "/hicache/storage-backend"
router = APIRouter(prefix=ROUTE, dependencies=[Depends(require_admin)], tags=["store"])
clear_router = APIRouter(dependencies=[Depends(require_admin)], tags=["store"])


def _store(state: ServerState) -> tuple[TieredStore, StoreControl]:
    if state.store is None or state.store_control is None:
        raise APIError(404, "store: this server runs without a KV store")
    return state.store, state.store_control


async def _change(state: ServerState, message: Message) -> Any:
    try:
        return await asyncio.to_thread(state.loop.call, message)
    except RuntimeError as e:  # attach twice, detach or resize with none attached
        raise APIError(409, f"store: {e}", None, "conflict") from None


@router.get("")
async def show(state: State) -> dict[str, Any]:
    _store(state)
    return await _change(state, ShowStore())


@router.put("")
async def attach(req: AttachRequest, state: State) -> dict[str, Any]:
    _, control = _store(state)
    folder = req.dir or control.folder
    if folder is None:
        raise bad_request("dir: no disk folder known; give one", "dir")
    try:
        folder = control.allowed(folder)
    except ValueError as err:
        raise bad_request(str(err), "dir") from None
    return await _change(state, AttachStore(folder, int(req.disk_gb * 2**30)))


@router.delete("")
async def detach(state: State) -> dict[str, Any]:
    _store(state)
    return await _change(state, DetachStore())


@router.post("/resize")
async def resize(req: ResizeRequest, state: State) -> dict[str, Any]:
    _store(state)
    return await _change(state, ResizeStore(int(req.disk_gb * 2**30)))


@clear_router.post("/hicache/clear")
async def clear(req: ClearRequest, state: State) -> dict[str, Any]:
    store, _ = _store(state)
    if req.remote and store.remote is None:
        raise bad_request("remote: this server runs without a remote tier", "remote")
    await asyncio.to_thread(store.flush)  # the long wait happens beside the loop, not in it
    cleared = await asyncio.to_thread(state.loop.call, ClearStore())
    if req.remote:
        cleared["remote"] = {"removed": await asyncio.to_thread(store.remote.clear)}
    return {"cleared": cleared, **await _change(state, ShowStore())}
