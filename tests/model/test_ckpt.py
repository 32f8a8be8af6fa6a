"""Orbax conversion: `python -m flipjax.ckpt convert` then restore into PP and TP gives the
logits of loading the HF folder; inspect lists the tree; bad conversions are refused."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax import Engine, ckpt
from flipjax.model import orbax_io as orbax_ckpt
from flipjax.model.config import ModelConfig
from flipjax.model.tiny import tiny_config
from flipjax.runtime.model_runner import Row
from sharding.layout import placement_for
from tests.support.hf_oracle import make_checkpoint
from tests.support.internals import parts

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    hf = str(tmp_path_factory.mktemp("hf"))
    make_checkpoint(hf, seed=2)
    out = str(tmp_path_factory.mktemp("orbax") / "converted")
    ckpt.main(["convert", hf, out, "--dtype", "float32"])
    return hf, out


def prefill_logits(engine: Engine) -> np.ndarray:
    """Last-token logits of PROMPT through the engine's own placement (any layout)."""
    inside = parts(engine)
    pool, slots = inside.allocator.pages, inside.allocator.slots
    pages = pool.allocate(1, "t")
    slot = slots.allocate("t")
    try:
        logits = inside.runner.run([Row(PROMPT, 0, pages, slot)], decode=False)
        return np.asarray(logits[0])
    finally:
        pool.release(pages, "t")
        slots.release(slot, "t")


def test_restore_into_layouts_matches_hf(folders):
    hf, out = folders
    assert orbax_ckpt.is_orbax(out) and not os.path.exists(out + ".partial")
    want = prefill_logits(Engine.from_pretrained(hf))
    for layout in ("pp:3,1", "tp:2", None):
        engine = Engine.from_pretrained(out, layout=layout)
        np.testing.assert_allclose(prefill_logits(engine), want, atol=1e-5, rtol=0)


def test_restore_reads_straight_into_shardings(folders):
    _, out = folders
    cfg = ModelConfig.from_hf(out)
    _, abstract = orbax_ckpt.abstract_params(cfg, jnp.float32)
    shardings = placement_for("pp:3,1@2,2", cfg).param_shardings(abstract)
    params = orbax_ckpt.restore_params(out, cfg, abstract, shardings)
    q = params["model"]["layers"][3]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding.device_set == set(jax.devices()[2:4])  # the second stage's devices
    assert {s.data.shape[1] for s in q.addressable_shards} == {q.shape[1] // 2}  # heads split


def test_inspect_lists_every_array(folders, capsys):
    _, out = folders
    ckpt.main(["inspect", out])
    lines = capsys.readouterr().out.splitlines()
    names = {line.split()[0] for line in lines[:-1]}
    assert "model.layers.3.self_attn.q_proj.kernel" in names
    assert "model.embed_tokens.weight" in names
    rows = orbax_ckpt.inspect(out)
    assert lines[-1].startswith(f"{len(rows)} arrays, {sum(r[3] for r in rows):,d} bytes")


def test_refusals(folders, tmp_path):
    hf, out = folders
    with pytest.raises(FileExistsError, match="already exists"):
        ckpt.main(["convert", hf, out])
    bad = tmp_path / "future"
    bad.mkdir()
    (bad / orbax_ckpt.MARKER).write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        orbax_ckpt.inspect(str(bad))


def test_each_load_gets_an_abstract_state_of_its_own():
    """The traced shapes are kept per config, and what one load fills is not the next's."""
    cfg = tiny_config()
    graph, first = orbax_ckpt.abstract_params(cfg, jnp.float32)
    first["model"]["norm"] = "filled"
    again, second = orbax_ckpt.abstract_params(cfg, jnp.float32)
    assert again is graph
    assert isinstance(second["model"]["norm"]["weight"].value, jax.ShapeDtypeStruct)
