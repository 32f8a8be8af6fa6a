"""Store control routes (admin): look at, attach, detach and resize the disk tier while serving.

    GET    /hicache/storage-backend          tiers, budgets and counters
    PUT    /hicache/storage-backend          {"disk_gb": 8, "dir"?: path}: attach a disk tier
    DELETE /hicache/storage-backend          detach (queued writes land first; files stay)
    POST   /hicache/storage-backend/resize   {"disk_gb": 2}: shrinking evicts at once

Every change runs on the engine loop thread between two steps, so no step sees half of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from flipjax.engine.engine import Engine
from serve.engine_loop import EngineLoop
from serve.protocol import error, parse
from store.disk import DiskTier
from store.tiered import TieredStore

ROUTE = "/hicache/storage-backend"


@dataclass
class StoreControl:
    """What re-attaching a disk tier needs: the identity its entries carry, and a folder."""

    identity: bytes
    folder: str | None  # where the disk tier lives (or last lived)


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    disk_gb: float = Field(gt=0)
    dir: str | None = None


class ResizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    disk_gb: float = Field(gt=0)


def add_store_routes(
    app: FastAPI,
    engine: Engine,
    loop: EngineLoop,
    control: StoreControl | None,
    refusal: Callable[[Request], JSONResponse | None],
) -> None:
    def tiered() -> TieredStore | None:
        bridge = engine.prefix_store
        return None if bridge is None else bridge.store

    def describe(store: TieredStore) -> dict[str, Any]:
        disk = store.disk
        return {
            "host": {"budget_bytes": store.host.budget_bytes, "used_bytes": store.host.used_bytes},
            "disk": None if disk is None else {
                "dir": disk.root, "budget_bytes": disk.budget_bytes, "used_bytes": disk.used_bytes,
            },
            "counters": store.stats(),
        }  # fmt: skip

    async def run(request: Request, change: Callable[[TieredStore], Any]) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        store = tiered()
        if store is None or control is None:
            return error(404, "store: this server runs without a KV store", None, "not_found")
        try:
            await asyncio.to_thread(loop.call, lambda _: change(store))
        except RuntimeError as e:  # attach twice, detach or resize with none attached
            return error(409, f"store: {e}", None, "conflict")
        return JSONResponse(describe(store))

    @app.get(ROUTE)
    async def show(request: Request) -> Response:
        return await run(request, lambda store: None)

    @app.put(ROUTE)
    async def attach(request: Request) -> Response:
        req = await parse(request, AttachRequest)
        if isinstance(req, JSONResponse):
            return req
        folder = req.dir or (control.folder if control else None)
        if folder is None:
            return error(400, "dir: no disk folder known; give one", "dir", "invalid_request_error")

        def attach_disk(store: TieredStore) -> None:
            if store.disk is not None:
                raise RuntimeError(f"a disk tier is attached already at {store.disk.root}")
            store.attach_disk(DiskTier(folder, control.identity, int(req.disk_gb * 2**30)))
            control.folder = folder

        return await run(request, attach_disk)

    @app.delete(ROUTE)
    async def detach(request: Request) -> Response:
        def detach_disk(store: TieredStore) -> None:
            if store.detach_disk() is None:
                raise RuntimeError("no disk tier is attached")

        return await run(request, detach_disk)

    @app.post(ROUTE + "/resize")
    async def resize(request: Request) -> Response:
        req = await parse(request, ResizeRequest)
        if isinstance(req, JSONResponse):
            return req
        return await run(request, lambda store: store.resize_disk(int(req.disk_gb * 2**30)))
