"""How the plan broadcast encodes an announcement: pickle, read back with only the globals an
announcement can hold.

An announcement is a method's name and its host arguments: ints, strings, lists, dicts, bytes,
numpy arrays and scalars, and the few classes marked `carried` (a step's `Row`). Plain pickle
would run whatever callable a message names, so a forged or corrupted message on the cluster's
transport could run code on every follower. The decoder resolves only numpy's array and scalar
constructors, the dtypes jax uses, and the carried classes; any other global is refused, naming
it, before anything is built.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

T = TypeVar("T", bound=type)
_CARRIED: set[tuple[str, str]] = set()


class PlanRefused(ValueError):
    """An announcement that is not one process 0 could have sent."""


def carried(cls: T) -> T:
    """Mark a class as one an announcement may carry: a plain data class, which a message can
    only fill with fields."""
    _CARRIED.add((cls.__module__, cls.__qualname__))
    return cls


def encode(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    return pickle.dumps((name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The announcement in `data`; `PlanRefused` naming what it may not hold."""
    try:
        message = _Decoder(io.BytesIO(data)).load()
    except PlanRefused:
        raise
    except Exception as err:  # noqa: BLE001 - any malformed message is refused alike
        raise PlanRefused(f"plan broadcast: an unreadable message ({err})") from None
    if not (
        isinstance(message, tuple)
        and len(message) == 3
        and isinstance(message[0], str)
        and isinstance(message[1], tuple)
        and isinstance(message[2], dict)
    ):
        raise PlanRefused("plan broadcast: a message that is not (name, args, kwargs)")
    return message


class _Decoder(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CARRIED or (module, name) in _numpy_globals():
            return super().find_class(module, name)
        raise PlanRefused(f"plan broadcast: {module}.{name} is not a type an announcement holds")


@functools.cache
def _numpy_globals() -> frozenset[tuple[str, str]]:
    """The globals numpy's own pickles of arrays and scalars name, for every dtype jax uses
    (recorded from examples, since numpy's module paths differ between versions)."""
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    dtypes = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64, np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
              ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4,
              ml_dtypes.uint4]  # fmt: skip
    for dtype in dtypes:
        for example in (np.zeros(2, dtype), np.zeros(2, dtype)[0]):
            Recorder(io.BytesIO(pickle.dumps(example, protocol=pickle.HIGHEST_PROTOCOL))).load()
    return frozenset(seen)
