"""The plan broadcast's messages: what process 0 announces reads back whole, and a message that
names any other global (a function to call, a class to build) is refused before anything runs.
The real two-process cluster is `test_multihost.py`."""

from __future__ import annotations

import os
import pickle

import ml_dtypes
import numpy as np
import pytest

from flipjax.runtime import mirror
from flipjax.runtime.model_runner import Row
from flipjax.runtime.plan_codec import PlanRefused, decode, encode


def test_an_announcement_reads_back_whole():
    rows = [Row([1, 2, 3], 0, [4, 5], 1), Row([7], 9, [2], 0, targets=[8])]
    kv = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    args = (rows, True, np.int64(3), [1, 2], kv, {"a": (np.float32(0.5), b"x")})
    name, got, kwargs = decode(encode("ModelRunner.run", args, {"score": None}))
    assert name == "ModelRunner.run" and kwargs == {"score": None}
    assert got[0] == rows and got[1:4] == args[1:4]
    assert got[4].dtype == ml_dtypes.bfloat16 and np.array_equal(got[4], kv)
    assert got[5] == args[5]


class Exploit:
    """What a forged message could hold: unpickling it would run `os.makedirs(path)`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


@pytest.mark.parametrize(
    "payload,named",
    [
        (lambda p: Exploit(p), f"{os.makedirs.__module__}.makedirs"),
        (lambda p: print, "builtins.print"),
        (lambda p: Exploit, f"{Exploit.__module__}.Exploit"),
    ],
)
def test_a_message_naming_another_global_is_refused_before_it_runs(tmp_path, payload, named):
    target = str(tmp_path / "made")
    data = pickle.dumps(("ModelRunner.run", (payload(target),), {}))
    with pytest.raises(PlanRefused, match=rf"{named} is not a type an announcement holds"):
        decode(data)
    assert not os.path.exists(target)


def test_malformed_messages_are_refused_by_name():
    with pytest.raises(PlanRefused, match="unreadable message"):
        decode(b"\x80\x05garbage")
    with pytest.raises(PlanRefused, match=r"not \(name, args, kwargs\)"):
        decode(pickle.dumps(["ModelRunner.run", (), {}]))


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
