"""One request's fault fails that request only.

The host work a step does for each request (seeding its prefix when it is admitted, building
its sampler row, taking its token in, detokenizing and checking its stops, publishing its
pages) runs under `Faults.guard`. An exception there marks that request finished with reason
"error" and a message that carries a reference to the stack in the log; the step goes on for
the others, and the engine frees the request like any finished one. Batch-wide work (the
model's forward pass, the batched sampler) is not attributable to one request, and a
`ProcessLost` is the cluster's, not a request's: both still raise out of the step.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from flipjax.engine.sequence import Sequence
from flipjax.runtime.multihost import ProcessLost

log = logging.getLogger(__name__)
T = TypeVar("T")

# The stages a request's host work runs in, as counted and named in its error.
STAGES = ("admitting", "sampling", "detokenizing", "publishing")


def describe_fault(stage: str, err: BaseException, request_id: str = "") -> str:
    """Log `err` with its stack under a fresh reference; the message naming it."""
    ref = f"err-{uuid.uuid4().hex[:12]}"
    stack = "".join(traceback.format_exception(err))
    log.error("%s failed (%s%s): %s", stage, ref, request_id and f", {request_id}", stack)
    return f"internal error while {stage} (reference {ref}): {type(err).__name__}: {err}"


class Faults:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()  # requests failed, by stage

    def guard(self, seq: Sequence, stage: str, work: Callable[[], T]) -> T | None:
        """`work`'s result for `seq`; None, with `seq` failed, if it raised."""
        try:
            return work()
        except ProcessLost:
            raise
        except Exception as err:  # noqa: BLE001 - this request's fault, not the step's
            self.fail(seq, stage, err)
            return None

    def fail(self, seq: Sequence, stage: str, err: Exception) -> None:
        """Fail `seq` with `err`; one that had finished already keeps its output (a fault
        publishing its last page loses a cache entry, not its tokens)."""
        assert stage in STAGES, stage
        self.counters[stage] += 1
        error = describe_fault(stage, err, seq.request_id)
        if seq.finish_reason is None:
            seq.error, seq.finish_reason = error, "error"
