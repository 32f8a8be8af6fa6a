"""Bodies of the admin routes: the phase flip, aborts and the store's disk tier."""

from __future__ import annotations

from pydantic import Field

from serve.protocol.sampling import Strict


class FlipRequest(Strict):
    to: str
    reseed: bool = False  # drop the device prefix cache instead of moving it


class AbortRequest(Strict):
    request_id: str


class AttachRequest(Strict):
    disk_gb: float = Field(gt=0)
    dir: str | None = None


class ResizeRequest(Strict):
    disk_gb: float = Field(gt=0)


class ClearRequest(Strict):
    remote: bool = False  # also delete this model's entries from the shared remote tier
