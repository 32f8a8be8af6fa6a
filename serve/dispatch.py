"""Applies each engine-loop message to the engine and the store, on the loop thread.

The one place that knows how a route's request maps onto the engine's API and the store's
controls; `EngineLoop` calls `start` for each request it admits and `apply` for every other
message. Refusals raise (ValueError for bad input, KeyError for an unknown id, RuntimeError
for a conflict) and are the caller's, never the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flipjax.engine.engine import Engine
from flipjax.engine.pilot import Autopilot
from flipjax.engine.stats import EngineStats
from serve import messages as m
from serve.store_control import StoreControl, describe
from store.disk import DiskTier
from store.tiered import TieredStore


@dataclass(frozen=True)
class Phase:
    """The answer to `ReadPhase`: the engine's stats and the phase policy's state."""

    stats: EngineStats
    policy: dict[str, Any]


class Dispatcher:
    def __init__(
        self,
        engine: Engine,
        store: TieredStore | None = None,
        control: StoreControl | None = None,
        autopilot: Autopilot | None = None,
    ):
        self.engine = engine
        self.store = store
        self.control = control  # what an attached disk tier needs: identity, free space
        self.autopilot = autopilot

    def start(self, request: m.Start) -> str:
        """Queue one request; its id."""
        e = self.engine
        if isinstance(request, m.Branch):
            return e.branch(
                request.checkpoint_id,
                request.sampling,
                request.max_new_tokens,
                session_id=request.session_id,
                prompt=request.prompt,
            )
        return e.add_request(
            request.prompt,
            request.sampling,
            max_new_tokens=request.max_new_tokens,
            session_id=request.session_id,
            chat=request.chat,
            n=request.n,
            grammar=request.grammar,
            cache_salt=request.cache_salt,
        )

    def apply(self, message: m.Message) -> Any:
        e = self.engine
        match message:
            case m.Flip(to, reseed):
                return e.flip(to, reseed)
            case m.ReadStats():
                return e.stats()
            case m.ReadMemory():
                return e.memory()
            case m.ReadPhase():
                pilot = self.autopilot
                return Phase(e.stats(), pilot.describe() if pilot else {"policy": "manual"})
            case m.FlushCache():
                return e.flush_prefix_cache()
            case m.ReadSession(session_id):
                return e.session(session_id)
            case m.Checkpoint(request_id, session_id, position, quiesce):
                return e.checkpoint(request_id, session_id, position, quiesce)
            case m.Rewind(session_id, checkpoint_id):
                return e.rewind(session_id, checkpoint_id)
            case m.ListCheckpoints():
                return e.list_checkpoints()
            case m.DeleteCheckpoint(checkpoint_id):
                return e.delete_checkpoint(checkpoint_id)
            case m.ShowStore() | m.AttachStore() | m.DetachStore() | m.ResizeStore():
                return self._store_change(message)
            case m.ClearStore():
                return self._store().clear()
        raise TypeError(f"engine loop: {type(message).__name__} is not a message it applies")

    def _store(self) -> TieredStore:
        if self.store is None:
            raise LookupError("store: this server runs without a KV store")
        return self.store

    def _store_change(self, message: m.Message) -> dict[str, Any]:
        store = self._store()
        match message:
            case m.AttachStore(folder, budget):
                if store.disk is not None:
                    raise RuntimeError(f"a disk tier is attached already at {store.disk.root}")
                control = self.control
                if control is None:
                    raise LookupError("store: this server runs without store control")
                disk = DiskTier(folder, control.identity, budget, control.min_free_bytes)
                store.attach_disk(disk)
                control.folder = folder
            case m.DetachStore():
                disk = store.detach_disk()
                if disk is None:
                    raise RuntimeError("no disk tier is attached")
                disk.close()
            case m.ResizeStore(budget):
                store.resize_disk(budget)
        return describe(store)
