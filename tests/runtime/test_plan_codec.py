"""The plan broadcast's messages (msgpack, never pickle): what process 0 announces reads back equal
in value and in type, and a message holding anything else, or malformed, is refused by name
before anything is built or called. The real two-process cluster is `test_multihost.py`."""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest

import sharding.flip  # noqa: F401 - its mirrored methods are among those checked here
from flipjax.runtime import mirror, plan_codec
from flipjax.runtime.model_runner import Row
from flipjax.runtime.plan_codec import PlanRefused, decode, encode

NUMPY = "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64"
ML = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]
JAX_DTYPES = [*map(np.dtype, NUMPY.split()), *map(np.dtype, ML), np.dtype(ml_dtypes.uint4)]
rng = np.random.default_rng(0)
KV = rng.standard_normal((3, 2, 2, 16, 2, 8)).astype(ml_dtypes.bfloat16)  # the store's pages
REC = rng.standard_normal((3, 4, 8, 8)).astype(np.float32)  # a GDN state: recurrent, conv
CONV = rng.standard_normal((3, 3, 48)).astype(ml_dtypes.bfloat16)
WRITE = ("ModelRunner.write", ([5, 6, 7], KV, 2, REC, CONV), {})
# Every mirrored operation, with arguments as its callers build them (engine/step.py,
# engine/prefix_reuse.py, engine/caches.py, engine/speculation.py, sharding/flip.py).
REAL = [
    ("ModelRunner.run", ([Row(list(range(40, 57)), 16, [3, 4], 1)],), {"decode": False}),
    ("ModelRunner.run", ([Row([5, 6, 7], 0, [9], 2, targets=[6, 7, 8])], False, 4), {}),
    ("ModelRunner.run", ([Row([7], 33, [3, 4, 5], 1), Row([9], 12, [0], 3)],), {"decode": True}),
    WRITE,
    ("ModelRunner.read_pages", ([3, 4],), {}),
    ("ModelRunner.read_slot", (1,), {}),
    ("ModelRunner.copy_slot", (1, 2), {}),
    ("ModelRunner.verify", ([Row([7, 8, 9], 33, [3, 4, 5], 1)], [[10, 11, 1]]), {}),
    ("ModelRunner.copy_page", (4, 9), {}),
    ("ModelRunner.warmup", (), {}),
    ("ModelRunner.warm_state_io", (), {}),
    ("Layouts.prepare", ("pp:2,2@2,2", True), {}),
    ("Layouts.move", ("tp:4", [0, 1, 2, 63], [1, 3]), {}),
]


def layout(a: np.ndarray) -> tuple[Any, ...]:
    return a.dtype, a.shape, a.flags.c_contiguous, a.flags.f_contiguous


def same(a: Any, b: Any) -> None:
    """`b` equals `a` in value and type all the way down (arrays: dtype, shape, order, bits)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert layout(a) == layout(b) and a.tobytes(order="A") == b.tobytes(order="A")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same(a[key], b[key])
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.generic):
        assert a.tobytes() == b.tobytes()
    else:
        assert a == b


def test_every_mirrored_operation_has_a_real_announcement_here():
    assert {name for name, _, _ in REAL} == mirror._MIRRORED - {"stop", "ping"}


@pytest.mark.parametrize("message", REAL, ids=lambda m: m[0])
def test_a_real_announcement_reads_back_whole(message):
    same(decode(encode(*message)), message)


def test_every_kind_of_value_reads_back_with_its_type():
    plain = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("inf")]
    nested = ["", "päge", b"", b"\x00\xff", [], (), {}, [1, [2, (3, [4, ()])]], ((),)]
    mixed = {"a": (np.float32(0.5), b"x"), "b": {"c": [None, np.int64(3)]}}
    odd = [np.zeros((), np.int32), np.array(3.5, ml_dtypes.bfloat16), np.zeros((0, 3), "f4")]
    odd += [np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.array([1, -2], ml_dtypes.int4)]
    every = [np.arange(24).astype(d).reshape(2, 3, 4) for d in JAX_DTYPES]
    values = (*plain, *nested, mixed, *odd, *every, *[a[1, 2, 3] for a in every])
    kwargs = {"score": None, "rows": [Row([1], 0, [2], 3)], "t": (np.uint8(7),)}
    same(decode(encode("X.y", values, kwargs)), ("X.y", values, kwargs))


def test_an_array_arrives_contiguous_and_writable():
    view = np.arange(40, dtype=np.float32).reshape(4, 10)[:, ::3]
    got = decode(encode("X.y", (view,), {}))[1][0]
    assert got.flags.c_contiguous and got.flags.writeable and np.array_equal(got, view)


class Exploit:
    """What a forged message could hold: unpickling it would run `os.makedirs(path)`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


CALLS: list[str] = []


class Recorder:
    """A class a message may name: building it would record the call."""

    def __init__(self, x: int = 0):
        CALLS.append(f"Recorder({x})")

    def __reduce__(self):
        return Recorder, (1,)


@plan_codec.carried
@dataclasses.dataclass
class Noted:
    x: int

    def __post_init__(self) -> None:
        CALLS.append(f"Noted({self.x})")


def test_decoding_builds_nothing_but_carried_classes(tmp_path):
    CALLS.clear()
    target = str(tmp_path / "made")
    forged = [
        pickle.dumps(("ModelRunner.run", (Exploit(target),), {})),
        pickle.dumps(("ModelRunner.run", (Recorder.__new__(Recorder),), {})),
        craft(["X.y", [ext(plan_codec.CARRIED, [f"{__name__}.Recorder", {"x": 2}])], {}]),
        craft(["X.y", [ext(plan_codec.CARRIED, ["builtins.print", {}])], {}]),
    ]
    for data in forged:
        with pytest.raises(PlanRefused):
            decode(data)
    assert CALLS == [] and not os.path.exists(target)
    sent = Noted(4)
    CALLS.clear()
    assert decode(encode("X.y", (sent,), {}))[1] == (sent,)
    assert CALLS == ["Noted(4)"]  # a carried class is built, once, through its constructor


def craft(obj: Any, raw: bytes = b"") -> bytes:
    """A message as a forger would write it: its msgpack object's length, the object, `raw`."""
    return framed(msgpack.packb(obj, use_bin_type=True), raw)


def framed(tree: bytes, raw: bytes = b"") -> bytes:
    return len(tree).to_bytes(8, "little") + tree + raw


def ext(code: int, obj: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(obj, use_bin_type=True))


def row_fields(**change: Any) -> dict[str, Any]:
    fields = {"tokens": [1], "start": 0, "pages": [2], "slot": 3, "targets": None, **change}
    return {k: v for k, v in fields.items() if v != "drop"}


def array(dtype: str, shape: list[Any], raw: bytes) -> bytes:
    return craft(["X.y", [ext(plan_codec.ARRAY, [dtype, shape, False])], {}], raw)


def nested(depth: int) -> Any:
    return ext(plan_codec.TUPLE, [nested(depth - 1)]) if depth else 0


ROW = f"{Row.__module__}.Row"
REFUSED = {
    "pickle": (lambda: pickle.dumps(("ModelRunner.run", (), {})), "unreadable"),
    "pickle-v0": (lambda: pickle.dumps(("ModelRunner.run", (), {}), protocol=0), "unreadable"),
    "empty": (lambda: b"", "unreadable"),
    "cut-message": (lambda: encode(*REAL[0])[:-3], "unreadable"),
    "cut-object": (lambda: framed(msgpack.packb(["X.y", [1, 2, 3], {}])[:-3]), "unreadable"),
    "cut-arrays": (lambda: encode(*WRITE)[:-1], r"needs \d+ bytes, \d+ left"),
    "trailing": (lambda: encode(*WRITE) + b"\0", "1 bytes after the last array"),
    "declared-long": (lambda: (1 << 20).to_bytes(8, "little") + b"\x90", "unreadable"),
    "not-a-list": (lambda: craft({"X.y": []}), r"unreadable.*not \[name, args, kwargs\]"),
    "name-not-str": (lambda: craft([5, [], {}]), "operation name of type int, not str"),
    "keyword-not-str": (lambda: craft(["X.y", [], {b"k": 1}]), "keyword that is not a str"),
    "int-key": (lambda: craft(["X.y", [{1: 2}], {}]), "unreadable.*map key"),
    "ext-code": (lambda: craft(["X.y", [msgpack.ExtType(9, b"")], {}]), "ext code 9 is not"),
    "timestamp": (lambda: craft(["X.y", [msgpack.Timestamp(1)], {}]), "Timestamp is not a type"),
    "not-carried": (
        lambda: craft(["X.y", [ext(plan_codec.CARRIED, ["os.system", {}])], {}]),
        "'os.system' is not a carried class",
    ),
    "unknown-field": (
        lambda: craft(["X.y", [ext(plan_codec.CARRIED, [ROW, row_fields(evil=1)])], {}]),
        r"Row has no field \['evil'\]",
    ),
    "missing-field": (
        lambda: craft(["X.y", [ext(plan_codec.CARRIED, [ROW, row_fields(slot="drop")])], {}]),
        r"Row is missing \['slot'\]",
    ),
    "object-dtype": (lambda: array("object", [1], bytes(8)), "dtype 'object' is not one"),
    "scalar-dtype": (
        lambda: craft(["X.y", [ext(plan_codec.SCALAR, ["complex64", bytes(8)])], {}]),
        "dtype 'complex64' is not one",
    ),
    "scalar-size": (
        lambda: craft(["X.y", [ext(plan_codec.SCALAR, ["int64", bytes(4)])], {}]),
        "scalar of int64 that is not 8 bytes",
    ),
    "short-bytes": (lambda: array("float32", [4], bytes(8)), "needs 16 bytes, 8 left"),
    "huge-shape": (lambda: array("float32", [2**40, 2**40], bytes(8)), r"needs \d+ bytes"),
    "negative-dim": (lambda: array("float32", [-1], b""), "shape"),
    "too-deep": (lambda: craft(["X.y", [nested(40)], {}]), "nested deeper than"),
    "deep-lists": (lambda: framed(b"\x91" * 2000 + b"\xc0"), "unreadable"),
}


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_a_malformed_or_forbidden_message_is_refused_naming_why(case):
    make, why = REFUSED[case]
    with pytest.raises(PlanRefused, match=why):
        decode(make())


@pytest.mark.parametrize(
    "value,why",
    [
        ({1, 2}, "builtins.set is not a type"),
        (np.array([object()]), "dtype 'object' is not one"),
        (np.zeros(2, ">i4"), "dtype '>i4' is not one"),
        (np.complex64(1), "numpy.complex64 is not a type"),
        (Recorder.__new__(Recorder), "Recorder is not a type"),
        (2**64, "int 18446744073709551616 is outside 64 bits"),
    ],
    ids=["set", "object-array", "big-endian", "complex", "not-carried", "int-too-big"],
)
def test_process_0_refuses_to_announce_what_no_follower_reads(value, why):
    with pytest.raises(PlanRefused, match=why):
        encode("X.y", (value,), {})


def frames(monkeypatch: pytest.MonkeyPatch, replies: list[np.ndarray] | None) -> list[Any]:
    """Stand in for the collective: record what is sent; process 0 (None) gets it back, a
    follower gets `replies` in turn, and no more."""
    sent: list[np.ndarray] = []

    def broadcast(frame: np.ndarray) -> np.ndarray:
        assert replies is None or replies, "a broadcast process 0 did not make"
        sent.append(frame.copy())
        return frame if replies is None else replies.pop(0)

    monkeypatch.setattr(mirror.multihost_utils, "broadcast_one_to_all", broadcast)
    return sent


def test_a_message_longer_than_a_frame_arrives_whole(monkeypatch):
    data = encode(*WRITE)
    sent = frames(monkeypatch, None)
    assert len(data) > mirror.FRAME_BYTES and mirror._broadcast_message(data) == data
    frames(monkeypatch, sent)
    same(decode(mirror._broadcast_message(None)), WRITE)


def test_a_declared_length_over_the_bound_is_refused_before_the_rest(monkeypatch):
    frame = np.zeros(mirror.FRAME_BYTES, np.uint8)
    frame[:8] = np.frombuffer(np.uint64(mirror.MAX_MESSAGE_BYTES + 1).tobytes(), np.uint8)
    sent = frames(monkeypatch, [frame])
    with pytest.raises(PlanRefused, match=r"declares \d+ bytes, over the \d+"):
        mirror.follow({})
    assert len(sent) == 1  # no second broadcast (nor its buffer) for the declared rest


def test_process_0_refuses_a_message_over_the_bound_before_sending(monkeypatch):
    sent = frames(monkeypatch, None)
    monkeypatch.setattr(mirror, "MAX_MESSAGE_BYTES", 64)
    with pytest.raises(PlanRefused, match=r"X.y: \d+ bytes, over the 64"):
        mirror.Channel().send("X.y", (list(range(100)),), {})
    assert sent == []


def test_a_follower_refuses_a_method_that_is_not_mirrored(monkeypatch):
    class Runner:
        def warmup(self) -> None:
            raise AssertionError("must not run")

        def __del__(self) -> None:  # a method no announcement may name
            pass

    sent = iter([encode("ModelRunner.__del__", (), {})])
    monkeypatch.setattr(mirror.Channel, "receive", lambda self: next(sent))
    with pytest.raises(PlanRefused, match="'ModelRunner.__del__' is not a mirrored operation"):
        mirror.follow({"ModelRunner": Runner()})
