"""The workspace a placement's step programs need, known before any pool exists: the pool a
budget can hold is what is left after the weights, the GDN slots, this and a reserve.

The widest decode step and the longest prefill step are compiled from shapes alone, over the
pool `shape` names (a step's temporaries do not grow with the pool: the pools are donated and
updated in place), and each device's largest temporary memory is read from
`compiled.memory_analysis()`. Nothing is allocated. The programs stay in the process's cache,
so where the pool keeps that size (an explicit `--num-pages` the budgets can hold) the engine
compiles them no second time.
"""

from __future__ import annotations

import weakref
from collections import Counter

import jax
from flax import nnx

from flipjax.runtime.binding import Binding, compile_programs
from flipjax.runtime.buckets import pages_for, pow2_bucket, prefill_bucket
from flipjax.runtime.compile_counter import CompileCounter
from flipjax.runtime.placement import Placement
from flipjax.runtime.runner_shape import RunnerShape
from flipjax.runtime.stages import ModelParts
from kernels_pallas import dispatch


def probe_workspace(
    graphdef: nnx.GraphDef, params: nnx.State, shape: RunnerShape, placement: Placement
) -> Counter[int]:
    """Per device id of `placement`, the largest temporary bytes of its widest decode and
    longest prefill step programs."""
    cfg = shape.cfg
    state = shape.pools()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    binding = Binding(
        placement,
        cfg,
        ModelParts.of(graphdef, params),
        dispatch.current_mode(),
        abstract,
        state,
        shape.dtype,
        pages_for(shape.max_model_len, shape.page_size),
        CompileCounter(),
    )
    decode = pow2_bucket(shape.max_running_requests)
    prefill = prefill_bucket(shape.max_prefill_tokens)
    # A pipeline runs each step in pieces: the pieces' shapes are the programs it compiles.
    shapes = [binding.split(b, t)[1:] for b, t in ((decode, 1), (1, prefill))]
    compile_programs(binding, shapes)
    return workspace(binding)


def workspace(binding: Binding, placement: Placement | None = None) -> Counter[int]:
    """Per device (by id), the largest temporary memory of the step and write programs
    compiled so far for `placement` (default: the binding's own) and the binding's model and
    pools."""
    placement = placement or binding.placement
    work: Counter[int] = Counter()
    for stage, step, write in binding.compiled(placement):
        temp = max(temp_bytes(step), temp_bytes(write))
        for device in placement.stages[stage].mesh.devices.flat:
            work[device.id] = max(work[device.id], temp)
    return work


def temp_bytes(compiled: object) -> int:
    """A compiled program's temporary memory per device (0 where the backend does not say).
    Kept per program: the analysis costs milliseconds, and a flip's room check reads dozens."""
    known = _TEMP.get(compiled)
    if known is None:
        analysis = compiled.memory_analysis()  # type: ignore[attr-defined]
        known = int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis else 0
        _TEMP[compiled] = known
    return known


# Weak keys: a program released from the process's cache takes its entry with it.
_TEMP: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
