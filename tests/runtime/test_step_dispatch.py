"""A compiled step takes each stage's parameters as one flat tuple of arrays, so a call has no
nnx nodes to flatten: dispatching the benchmark model's batch-8 step took 0.55 against 1.0 ms
of host time with the parameters' State."""

from __future__ import annotations

import jax
import pytest

from flipjax import Engine
from tests.support.internals import parts
from tests.support.speculation import PROMPTS, speculative

jit = jax.jit


@pytest.mark.parametrize("layout", [None, "pp:4,4"])
def test_every_stage_program_takes_its_parameters_as_flat_arrays(layout):
    engine = Engine.from_pretrained("tiny", layout=layout)
    binding = parts(engine).runner.binding
    for stage in range(len(binding.stages)):
        step, _ = binding.programs(stage, (2, 1))
        args, _kwargs = step.in_tree.children()
        params = args.children()[0]
        assert params.num_leaves > 10, "the step's first argument is not the parameters"
        assert params.num_nodes == params.num_leaves + 1, f"stage {stage}: {params}"[:200]


def test_the_draft_heads_programs_take_its_parameters_as_flat_arrays(monkeypatch):
    """The head's drafting after a verify step, as a stage's step: its parameters' nnx State
    took about 80 microseconds of host time a call to flatten."""
    structures = []

    def recording(fn, **options):
        program = jit(fn, **options)
        if not getattr(fn, "__qualname__", "").startswith("Drafter."):
            return program

        def call(params, *args):
            structures.append(jax.tree.structure(params))
            return program(params, *args)

        return call

    engine = speculative(3)
    monkeypatch.setattr(jax, "jit", recording)  # the head's programs are made on first use
    engine.generate(PROMPTS[:2], max_new_tokens=8)
    assert engine.stats().speculative.verify_rows > 0 and structures
    for tree in structures:
        assert tree.num_leaves > 10, "the program's first argument is not the parameters"
        assert tree.num_nodes == tree.num_leaves + 1, str(tree)[:200]
