"""The checkpoint book: session checkpoint manifests beside the store's entries, and the pins
that keep what they reference.

`create` refuses unless every page and the GDN anchor the checkpoint needs are in the store,
pins them, makes them durable on disk, and then writes the manifest atomically (temporary
file, fsync, rename, directory fsync), so a crash leaves a whole manifest or none, and never
one whose entries were still queued. `load` checks every reference again before
anything is seeded, naming the first one missing. `delete` unpins. Opening a book over an
existing folder re-pins what its manifests reference, so checkpoints survive restarts; a
manifest that cannot be read (another model, an unknown version, corrupt) is counted and left
in place, never used. Without a folder the book lives in memory only.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from flipjax.runtime.sampling import SamplingParams
from store.durable import fsync_path, replace_file
from store.entry import Kind
from store.keys import page_keys
from store.manifest import Manifest, ManifestError
from store.tiered import TieredStore

log = logging.getLogger("flipjax.store")


class CheckpointError(ValueError):
    """A checkpoint operation refused: its message names the reason."""


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint holds, free of any layout."""

    token_ids: list[int]  # every token up to the requested position
    prompt_len: int
    position: int  # on the grid: the store holds pages and the GDN anchor up to here
    sampling: SamplingParams
    seed: int
    chat: list[dict[str, str]] | None = None


# A checkpoint id: hex of its manifest's hash (`Manifest.checkpoint_id`).
_CHECKPOINT_ID = re.compile(r"[0-9a-f]{32}")
# Beside a book's manifests: what made them, in words, for the refusal of another server.
ABOUT = "about.txt"
_ABOUT_LIMIT = 1024


class CheckpointBook:
    def __init__(
        self, store: TieredStore, model: str, folder: str | None, about: str | None = None
    ):
        """`model`: the identity digest (hex) manifests must carry; `about`: what that identity
        is, in words (the model, its dtype, the KV pages' dtype), kept beside the manifests so
        that a server of another identity over the same store folder can name both when asked
        for a checkpoint of this one."""
        self.store = store
        self.model = model  # the model identity digest, hex
        self.folder = folder
        self.about = about
        self.counters: Counter[str] = Counter()
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            if about is not None:
                replace_file(os.path.join(folder, ABOUT), about.encode()[:_ABOUT_LIMIT])
            self._open()

    # -- the book -------------------------------------------------------------------------------

    def create(self, state: CheckpointState) -> dict[str, Any]:
        ps = self.store.page_size
        keys = page_keys(self.store.root, state.token_ids[: state.position], ps)
        if len(keys) * ps != state.position:
            raise CheckpointError(f"position: {state.position} is not a whole number of pages")
        manifest = Manifest(
            model=self.model,
            token_ids=tuple(state.token_ids),
            prompt_len=state.prompt_len,
            position=state.position,
            page_keys=tuple(k.hex() for k in keys),
            anchor_key=keys[-1].hex(),
            sampling=_sampling_dict(state.sampling),
            seed=state.seed,
            chat=None if state.chat is None else tuple(dict(m) for m in state.chat),
        )
        self._verify(manifest)  # a hybrid model's checkpoint needs its GDN anchor
        cid = manifest.checkpoint_id
        with self._lock:
            if cid not in self._manifests:
                self._pin(manifest)  # first: nothing it needs is evicted while it is written
                try:
                    if self.folder is not None:
                        self._persist(cid, manifest)
                except BaseException:
                    self._unpin(manifest)
                    raise
                self._manifests[cid] = manifest
                self.counters["created"] += 1
        return summary(cid, manifest)

    def load(self, checkpoint_id: str) -> CheckpointState:
        """The checkpoint's state, after checking every reference it needs is present."""
        manifest = self._get(checkpoint_id)
        self._verify(manifest)
        return CheckpointState(
            token_ids=list(manifest.token_ids),
            prompt_len=manifest.prompt_len,
            position=manifest.position,
            sampling=SamplingParams(**manifest.sampling),
            seed=manifest.seed,
            chat=None if manifest.chat is None else [dict(m) for m in manifest.chat],
        )

    def manifest(self, checkpoint_id: str) -> Manifest:
        return self._get(checkpoint_id)

    def references(self, checkpoint_id: str) -> list[tuple[bytes, Kind]]:
        """The store entries a checkpoint pins, its GDN anchor last."""
        return _references(self._get(checkpoint_id))

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [summary(cid, m) for cid, m in sorted(self._manifests.items())]

    def delete(self, checkpoint_id: str) -> None:
        with self._lock:
            manifest = self._manifests.pop(checkpoint_id, None)
            if manifest is None:
                raise KeyError(f"checkpoint_id: {checkpoint_id!r} is not a checkpoint here")
            self._unpin(manifest)
            if self.folder is not None:
                os.remove(self._path(checkpoint_id))
                fsync_path(self.folder)
            self.counters["deleted"] += 1

    # -- internals ------------------------------------------------------------------------------

    def _get(self, checkpoint_id: str) -> Manifest:
        with self._lock:
            manifest = self._manifests.get(checkpoint_id)
        if manifest is None:
            raise KeyError(self._unknown(checkpoint_id))
        return manifest

    def _unknown(self, checkpoint_id: str) -> str:
        """Why `checkpoint_id` is refused: unknown, or made by a server of another identity
        over the same store folder (another model, dtype or KV pages' dtype), named."""
        unknown = f"checkpoint_id: {checkpoint_id!r} is not a checkpoint here"
        if self.folder is None or not _CHECKPOINT_ID.fullmatch(checkpoint_id):
            return unknown  # only an id of hex digits ever reaches the file system
        ours = os.path.dirname(os.path.abspath(self.folder))
        store_dir = os.path.dirname(ours)
        try:
            names = sorted(os.listdir(store_dir))
        except OSError:  # the store folder unreadable or gone: nothing to name
            return unknown
        for name in names:
            if os.path.join(store_dir, name) == ours:
                continue
            other = os.path.join(store_dir, name, os.path.basename(self.folder))
            if os.path.isfile(os.path.join(other, f"{checkpoint_id}.json")):
                theirs = _read_about(other) or "another model identity"
                return (
                    f"checkpoint_id: {checkpoint_id!r} was made by a server with {theirs}; this "
                    f"one has {self.about or 'another'}. KV pages are never converted between "
                    "dtypes: restore it on a server started as the one that made it"
                )
        return unknown

    def _verify(self, manifest: Manifest) -> None:
        self.counters["verified"] += 1
        for i, (key, kind) in enumerate(_references(manifest)):
            if self.store.where(key, kind) is None:
                self.counters["missing"] += 1
                what = "GDN anchor" if kind == Kind.GDN_ANCHOR else f"page {i}"
                raise CheckpointError(
                    f"checkpoint: its {what} ({key.hex()[:16]}...) is not in the store"
                )

    def _pin(self, manifest: Manifest) -> None:
        for key, kind in _references(manifest):
            self.store.pin(key, kind)

    def _unpin(self, manifest: Manifest) -> None:
        for key, kind in _references(manifest):
            self.store.unpin(key, kind)

    def _persist(self, checkpoint_id: str, manifest: Manifest) -> None:
        """The entries the checkpoint references durable on disk, then its manifest: a crash
        between the two leaves entries no manifest names, never a manifest without them."""
        lost = _make_durable(self.store, _references(manifest))
        if lost:
            self.counters["not_durable"] += 1
            raise CheckpointError(
                f"checkpoint: {len(lost)} of its {len(_references(manifest))} store entries "
                "could not be written to disk, so it would not survive a restart"
            )
        self._write(checkpoint_id, manifest.to_bytes())

    def _path(self, checkpoint_id: str) -> str:
        return os.path.join(self.folder, f"{checkpoint_id}.json")

    def _write(self, checkpoint_id: str, data: bytes) -> None:
        replace_file(self._path(checkpoint_id), data)

    def _open(self) -> None:
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if name.endswith(".tmp"):
                os.remove(path)  # a write a crash interrupted
                continue
            if not name.endswith(".json"):
                continue
            with open(path, "rb") as f:
                data = f.read()
            try:
                manifest = Manifest.from_bytes(data, self.model)
                if manifest.checkpoint_id != name.removesuffix(".json"):
                    raise ManifestError("manifest: its bytes do not hash to its name")
            except ManifestError as e:
                self.counters["unreadable"] += 1
                log.warning("checkpoint %s left unused: %s", name, e)
                continue
            self._pin(manifest)
            self._manifests[manifest.checkpoint_id] = manifest
            self.counters["loaded"] += 1


def _read_about(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, ABOUT), "rb") as f:
            return f.read(_ABOUT_LIMIT).decode("utf-8", "replace")
    except OSError:
        return None


def summary(checkpoint_id: str, manifest: Manifest) -> dict[str, Any]:
    return {
        "checkpoint_id": checkpoint_id,
        "requested_position": manifest.requested_position,
        "position": manifest.position,
        "prompt_tokens": min(manifest.prompt_len, manifest.requested_position),
        "generated_tokens": manifest.step,
        "pages": len(manifest.page_keys),
        "chat": manifest.chat is not None,
    }


def _references(manifest: Manifest) -> list[tuple[bytes, Kind]]:
    """Every entry a checkpoint needs, the GDN anchor last (it is fetched last too)."""
    refs = [(bytes.fromhex(k), Kind.KV_PAGE) for k in manifest.page_keys]
    return refs + [(bytes.fromhex(manifest.anchor_key), Kind.GDN_ANCHOR)]


def _sampling_dict(params: SamplingParams) -> dict[str, Any]:
    body = dict(vars(params))
    body["stop"], body["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    return body


def _make_durable(store: TieredStore, names: list[tuple[bytes, Kind]]) -> list[tuple[bytes, Kind]]:
    """Bring each entry of `names` to the store's disk tier, durably: queued writes land first,
    and one still only in host memory is written now. Returns those on no disk after that (no
    disk tier, no room, or gone)."""
    store.writes.flush()
    disk = store.disk
    if disk is None:
        return list(names)
    absent = [(k, kind) for k, kind in names if not disk.contains(k, kind)]
    held = [(k, kind, store.host.get(k, kind)) for k, kind in absent]
    items = [(k, kind, p) for k, kind, p in held if p is not None]
    accepted = disk.put_many(items) if items else []
    landed = {(k, kind) for (k, kind, _), ok in zip(items, accepted, strict=True) if ok}
    return [name for name in absent if name not in landed]
