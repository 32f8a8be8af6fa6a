"""Session checkpoint manifests: a small, versioned, deterministic record of references.

A checkpoint holds no KV itself. It names the content-keyed pages and the GDN anchor the store
already has, plus what a continuation needs to be byte-identical: every token id up to the
checkpoint, where the prompt ended, the sampling parameters and the sampler's RNG state (the
seed and the step, since draws are `fold_in(key(seed), step)`), and the chat messages of a chat
session. Nothing in it depends on the layout (no device, rank, stage or TP width).

The same checkpoint always serialises to the same bytes (canonical JSON), and its id is the
hash of those bytes. An unknown format version is refused, never parsed best-effort.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1


class ManifestError(ValueError):
    """A manifest that cannot be used: unknown version, another model, malformed."""


@dataclass(frozen=True)
class Manifest:
    model: str  # the model identity digest, hex
    token_ids: tuple[int, ...]  # every token up to the requested position
    prompt_len: int  # how many of them were the prompt; the rest were generated
    position: int  # the requested position snapped down to the GDN grid
    page_keys: tuple[str, ...]  # hex, one per page up to `position`
    anchor_key: str  # hex: the GDN anchor at `position`
    sampling: dict[str, Any]  # SamplingParams fields
    seed: int  # the sampler's RNG state is (seed, step)
    chat: tuple[dict[str, str], ...] | None = None  # messages so far, for a chat session
    version: int = field(default=FORMAT_VERSION)

    @property
    def requested_position(self) -> int:
        return len(self.token_ids)

    @property
    def step(self) -> int:
        """Tokens generated before the checkpoint: the sampler's next draw index."""
        return max(0, len(self.token_ids) - self.prompt_len)

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["requested_position"] = self.requested_position
        body["step"] = self.step
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def checkpoint_id(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()[:32]

    @classmethod
    def from_bytes(cls, data: bytes, model: str | None = None) -> Manifest:
        """Parse and check a manifest; `model`, when given, must be its model identity."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"manifest: not JSON ({e})") from None
        if not isinstance(body, dict):
            raise ManifestError("manifest: not a JSON object")
        version = body.get("version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest: format version {version!r} is not supported (this build reads "
                f"{FORMAT_VERSION})"
            )
        if model is not None and body.get("model") != model:
            raise ManifestError(
                f"manifest: made for model {str(body.get('model'))[:16]}..., not this server's "
                f"{model[:16]}..."
            )
        derived = {
            "requested_position": body.pop("requested_position", None),
            "step": body.pop("step", None),
        }
        try:
            chat = body.pop("chat")
            manifest = cls(
                **{k: tuple(v) if k in ("token_ids", "page_keys") else v for k, v in body.items()},
                chat=None if chat is None else tuple(chat),
            )
        except (TypeError, KeyError) as e:
            raise ManifestError(f"manifest: malformed ({e})") from None
        if derived != {"requested_position": manifest.requested_position, "step": manifest.step}:
            raise ManifestError("manifest: its positions do not match its tokens")
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Refuse a manifest whose fields contradict each other."""
        if not all(isinstance(t, int) and t >= 0 for t in self.token_ids):
            raise ManifestError("manifest: token_ids must be non-negative integers")
        if not 0 < self.position <= len(self.token_ids):
            raise ManifestError(
                f"manifest: position {self.position} is outside 1..{len(self.token_ids)}"
            )
        if not 0 <= self.prompt_len <= len(self.token_ids):
            raise ManifestError(f"manifest: prompt_len {self.prompt_len} is out of range")
        if not self.page_keys or not self.anchor_key:
            raise ManifestError("manifest: a checkpoint needs its pages and its GDN anchor")
