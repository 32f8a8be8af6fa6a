"""How the plan broadcast encodes an announcement: msgpack, read back allowing only the types an
announcement holds.

An announcement is a method's name and its host arguments: None, bools, ints, floats, strings,
bytes, lists, tuples, dicts with string keys, numpy arrays and scalars of the dtypes jax uses,
and the few dataclasses marked `carried` (a step's `Row`). Every follower runs what the
broadcast brings, so a forged or corrupted message must never run code there: this module must
never pickle, and its decoder must never import, look up or call a name a message gives, except
a carried class found in the registry `carried` fills, built from its declared fields. Anything
else, and anything malformed, is `PlanRefused`, naming it, before the operation runs.

A message is the length of one msgpack object (8 bytes, little-endian), the object
[name, args, kwargs], then the bytes of every array in it, in the order the arrays appear. The
bytes stay out of the msgpack object so that an array is copied once each way and may exceed
msgpack's 4 GiB limit on one value, while the object itself stays small and bounded. Ext types
carry what msgpack has no type for:

    ARRAY    [dtype name, shape, Fortran order]; its bytes follow the object
    SCALAR   [dtype name, its bytes]: a numpy scalar
    TUPLE    its items, packed (msgpack alone would make a list of them)
    CARRIED  [registered name, {field: value}]: an instance of a `carried` dataclass

Dict keys must be strings: a follower refuses any other (msgpack's strict map keys), and the
encoder does not look inside dicts to refuse them first (no mirrored method takes a dict).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

import ml_dtypes
import msgpack
import numpy as np

T = TypeVar("T", bound=type)

ARRAY, SCALAR, TUPLE, CARRIED = 1, 2, 3, 4  # the ext codes; a message with any other is refused

# The dtypes jax uses, by name: a message names one of these and never a dtype to construct.
_NUMPY = "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64"
_ML = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]
_DTYPES = {d.name: d for d in map(np.dtype, [*_NUMPY.split(), *_ML, ml_dtypes.uint4])}
_SCALARS = frozenset(d.type for d in _DTYPES.values())
_PLAIN = frozenset({type(None), bool, int, float, str, bytes, list, dict, tuple, np.ndarray})
_CARRIED: dict[str, tuple[type, tuple[str, ...]]] = {}  # name -> class, its constructor's fields
_NAMES: dict[type, str] = {}

_NOT_HELD = "is not one an announcement holds"
_HEADER = 8
# The msgpack object, arrays' bytes apart. Its bulk is page lists: a decode step of 1,024 rows
# of 262,144 tokens in 16-token pages lists 16M page ids, about 80 MiB.
_OBJECT_BYTES = 256 << 20
_MAX_DEPTH = 32  # tuples and carried objects within each other (real messages: 2)
_MAX_DIMS = 32
_LIMITS = dict(
    max_str_len=1 << 16,  # names, layouts, keys
    max_bin_len=_OBJECT_BYTES,
    max_array_len=1 << 22,  # the longest list: a row's page ids, or a flip's live pages
    max_map_len=1 << 10,  # keywords and a carried class's fields
    max_ext_len=_OBJECT_BYTES,
)


class PlanRefused(ValueError):
    """An announcement process 0 may not send, or a message no process 0 could have sent."""


def carried(cls: T) -> T:
    """Mark a dataclass as one an announcement may carry: a message can only name it and fill
    the fields its constructor takes."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"carried: {cls.__qualname__} is not a dataclass")
    name = f"{cls.__module__}.{cls.__qualname__}"
    _CARRIED[name] = (cls, tuple(f.name for f in dataclasses.fields(cls) if f.init))
    _NAMES[cls] = name
    return cls


def encode(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The message announcing `name(*args, **kwargs)`; `PlanRefused` naming a value no follower
    would read (raised on process 0 before anything is sent, so the cluster stays in step)."""
    arrays: list[np.ndarray] = []
    try:
        tree = _pack([name, list(args), kwargs], arrays)
    except PlanRefused:
        raise
    except (TypeError, ValueError, OverflowError) as err:  # msgpack's: an int out of range, ...
        raise PlanRefused(f"plan broadcast: {name} cannot be announced ({err})") from None
    if len(tree) > _OBJECT_BYTES:
        raise PlanRefused(f"plan broadcast: {name} has {len(tree)} bytes besides its arrays")
    return b"".join([len(tree).to_bytes(_HEADER, "little"), tree, *arrays])


def decode(data: bytes) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The announcement in `data`; `PlanRefused` naming what it may not hold."""
    view = memoryview(data)
    size = int.from_bytes(view[:_HEADER], "little")
    if len(view) < _HEADER or size > min(_OBJECT_BYTES, len(view) - _HEADER):
        raise PlanRefused(
            f"plan broadcast: an unreadable message ({len(view)} bytes, declaring {size})"
        )
    reader = _Reader(view[_HEADER + size :])
    message = reader.unpack(view[_HEADER : _HEADER + size])
    if not (
        type(message) is list
        and len(message) == 3
        and type(message[1]) is list
        and type(message[2]) is dict
    ):
        raise PlanRefused("plan broadcast: an unreadable message (not [name, args, kwargs])")
    name, args, kwargs = message
    if type(name) is not str:
        kind = type(name).__name__
        raise PlanRefused(f"plan broadcast: an operation name of type {kind}, not str")
    if not all(type(key) is str for key in kwargs):
        raise PlanRefused(f"plan broadcast: {name} with a keyword that is not a str")
    reader.finish()
    return name, tuple(args), kwargs


def _pack(obj: Any, arrays: list[np.ndarray]) -> bytes:
    """`obj` in msgpack; each array's bytes go to `arrays`, in the order the decoder meets them
    (msgpack calls `ext` as it reaches each value, and the decoder's hook likewise)."""

    def ext(value: Any) -> msgpack.ExtType:
        kind = type(value)  # exact types only (strict_types): a subclass could carry code
        if kind is tuple:
            return msgpack.ExtType(TUPLE, _pack(list(value), arrays))
        if kind is np.ndarray:
            fortran = value.flags.f_contiguous and not value.flags.c_contiguous
            header = [_dtype_name(value.dtype), list(value.shape), fortran]
            arrays.append(value.ravel("F" if fortran else "C").view(np.uint8))
            return msgpack.ExtType(ARRAY, _pack(header, arrays))
        if kind in _SCALARS:
            scalar = [_dtype_name(value.dtype), value.tobytes()]
            return msgpack.ExtType(SCALAR, _pack(scalar, arrays))
        if kind in _NAMES:
            name = _NAMES[kind]
            fields = {f: getattr(value, f) for f in _CARRIED[name][1]}
            return msgpack.ExtType(CARRIED, _pack([name, fields], arrays))
        if kind is int:  # msgpack asks only for an int it cannot hold
            raise PlanRefused(f"plan broadcast: int {value} is outside 64 bits")
        raise PlanRefused(f"plan broadcast: {_held(kind)}")

    return msgpack.packb(obj, default=ext, use_bin_type=True, strict_types=True)


class _Reader:
    """Unpacks one message's msgpack object, taking each array's bytes from `raw` in turn."""

    def __init__(self, raw: memoryview) -> None:
        self.raw, self.used, self.depth = raw, 0, 0
        self.allowed = _PLAIN | _SCALARS | {cls for cls, _ in _CARRIED.values()}

    def unpack(self, data: bytes | memoryview) -> Any:
        if self.depth >= _MAX_DEPTH:
            raise PlanRefused(f"plan broadcast: a message nested deeper than {_MAX_DEPTH}")
        self.depth += 1
        try:
            return msgpack.unpackb(
                data,
                ext_hook=self.ext,
                list_hook=self.checked,
                object_hook=self.checked,
                raw=False,
                strict_map_key=True,
                **_LIMITS,
            )
        except PlanRefused:
            raise
        except Exception as err:  # noqa: BLE001 - any malformed message is refused alike
            raise PlanRefused(f"plan broadcast: an unreadable message ({err!r})") from None
        finally:
            self.depth -= 1

    def checked(self, items: list[Any] | dict[str, Any]) -> Any:
        """`items` (a list, or a dict's values) if it holds only what an announcement may; the
        hooks only see lists and dicts, and msgpack makes other types too (Timestamp)."""
        values = items.values() if type(items) is dict else items
        if not self.allowed.issuperset(map(type, values)):
            odd = next(t for t in map(type, values) if t not in self.allowed)
            raise PlanRefused(f"plan broadcast: {_held(odd)}")
        return items

    def ext(self, code: int, data: bytes) -> Any:
        if code == TUPLE:
            return tuple(self.fields(data, None, "a tuple"))
        if code == ARRAY:
            dtype_name, shape, fortran = self.fields(data, 3, "an array")
            return self.array(_dtype(dtype_name), shape, fortran)
        if code == SCALAR:
            dtype_name, raw = self.fields(data, 2, "a scalar")
            dtype = _dtype(dtype_name)
            if type(raw) is not bytes or len(raw) != dtype.itemsize:
                raise PlanRefused(
                    f"plan broadcast: a scalar of {dtype.name} that is not {dtype.itemsize} bytes"
                )
            return np.frombuffer(raw, dtype)[0]
        if code == CARRIED:
            return self.carried(*self.fields(data, 2, "a carried object"))
        raise PlanRefused(f"plan broadcast: ext code {code} {_NOT_HELD}")

    def fields(self, data: bytes, n: int | None, what: str) -> list[Any]:
        """The list packed in an ext's `data`: `n` items (None: any number)."""
        items = self.unpack(data)
        if type(items) is not list or n not in (None, len(items)):
            raise PlanRefused(f"plan broadcast: {what} that is not a list of {n or 'its'} items")
        return items

    def array(self, dtype: np.dtype, shape: Any, fortran: Any) -> np.ndarray:
        if not (
            type(shape) is list
            and len(shape) <= _MAX_DIMS
            and all(type(n) is int and n >= 0 for n in shape)
            and type(fortran) is bool
        ):
            raise PlanRefused(f"plan broadcast: an array of shape {shape!r}, order {fortran!r}")
        size, left = math.prod(shape) * dtype.itemsize, len(self.raw) - self.used
        if size > left:  # before allocating: a forged shape may ask for anything
            raise PlanRefused(
                f"plan broadcast: a {dtype.name} array of shape {tuple(shape)} needs {size} "
                f"bytes, {left} left in the message"
            )
        flat = np.frombuffer(self.raw[self.used : self.used + size], np.uint8).copy()
        self.used += size
        # A copy, as pickle gave: writable and owning its memory, whatever the message's buffer.
        return flat.view(dtype).reshape(shape, order="F" if fortran else "C")

    def carried(self, name: Any, fields: Any) -> Any:
        cls, declared = _CARRIED.get(name, (None, ())) if type(name) is str else (None, ())
        if cls is None:
            raise PlanRefused(f"plan broadcast: {name!r} is not a carried class")
        if type(fields) is not dict:
            raise PlanRefused(f"plan broadcast: {name} without a map of its fields")
        if unknown := sorted(set(fields) - set(declared)):
            raise PlanRefused(f"plan broadcast: {name} has no field {unknown}")
        if missing := [f for f in declared if f not in fields]:
            raise PlanRefused(f"plan broadcast: {name} is missing {missing}")
        try:
            return cls(**fields)
        except Exception as err:  # noqa: BLE001 - its own checks refused the fields
            raise PlanRefused(f"plan broadcast: {name} refused its fields ({err})") from None

    def finish(self) -> None:
        if left := len(self.raw) - self.used:
            raise PlanRefused(f"plan broadcast: {left} bytes after the last array")


def _dtype(name: Any) -> np.dtype:
    if type(name) is not str or name not in _DTYPES:
        raise PlanRefused(f"plan broadcast: dtype {name!r} {_NOT_HELD}")
    return _DTYPES[name]


def _dtype_name(dtype: np.dtype) -> str:
    allowed = _DTYPES.get(dtype.name)
    if allowed is None or allowed != dtype:  # also another byte order, under the same name
        raise PlanRefused(f"plan broadcast: dtype {str(dtype)!r} {_NOT_HELD}")
    return dtype.name


def _held(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__} is not a type an announcement holds"
