"""Checkpoint loading: sharded files, tied embeddings, and refusals that name the tensor."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from flipjax import Engine
from flipjax.model.layers import Linear
from flipjax.model.weights import WeightsError
from tests.support.hf_oracle import make_checkpoint
from tests.support.internals import params, prompt_logits

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    make_checkpoint(
        folder,
        seed=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
    )
    return folder


@pytest.fixture(scope="module")
def reference_logits(checkpoint):
    return prompt_logits(Engine.from_pretrained(checkpoint), PROMPT)


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_the_same(checkpoint, reference_logits, tmp_path):
    folder = str(tmp_path / "sharded")
    os.makedirs(folder)
    shutil.copy(os.path.join(checkpoint, "config.json"), folder)
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for shard, chunk in enumerate((names[::2], names[1::2])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, os.path.join(folder, file))
        weight_map.update({n: file for n in chunk})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    np.testing.assert_array_equal(
        prompt_logits(Engine.from_pretrained(folder), PROMPT), reference_logits
    )


def test_mtp_tensors_are_ignored(checkpoint, reference_logits, tmp_path):
    folder = _copy(checkpoint, tmp_path / "mtp")
    _edit_tensors(folder, lambda t: t.update({"mtp.fc.weight": np.ones((4, 4), np.float32)}))
    np.testing.assert_array_equal(
        prompt_logits(Engine.from_pretrained(folder), PROMPT), reference_logits
    )


def test_bfloat16_load_keeps_bf16_weights(checkpoint, reference_logits):
    engine = Engine.from_pretrained(checkpoint, dtype="bfloat16")
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(params(engine))} == {"bfloat16"}
    logits = prompt_logits(engine, PROMPT)
    # bf16 keeps ~3 significant digits; through 4 layers the logits drift by about 0.15 here.
    assert np.abs(logits - reference_logits).max() < 0.25


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3, 5)])
def test_a_bf16_linear_is_the_fp32_product_rounded_for_one_row_and_many(lead):
    """One row takes its own path on the CPU (padded to two); every shape must give x @ kernel."""
    lin = Linear(64, 48, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (*lead, 64)).astype(jnp.bfloat16)
    want = x.astype(jnp.float32) @ lin.kernel[...].astype(jnp.float32)
    got = lin(x)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-7, atol=1e-6)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "missing")
    name = "model.layers.3.self_attn.k_norm.weight"
    _edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=f"missing tensors: {name}"):
        Engine.from_pretrained(folder)


def test_missing_expert_is_named(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "missing_expert")
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    _edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=name):
        Engine.from_pretrained(folder)


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "misshaped")
    name = "model.layers.0.linear_attn.in_proj_ba.weight"
    _edit_tensors(folder, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(WeightsError, match=rf"wrongly shaped tensors: {name} \(expected"):
        Engine.from_pretrained(folder)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "unexpected")
    _edit_tensors(
        folder, lambda t: t.update({"model.layers.0.extra.weight": np.ones(3, np.float32)})
    )
    with pytest.raises(WeightsError, match="unexpected tensors: model.layers.0.extra.weight"):
        Engine.from_pretrained(folder)


def test_bad_config_is_refused_before_weights(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "badcfg")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["num_key_value_heads"] = 3
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Engine.from_pretrained(folder)


def test_tied_embeddings(tmp_path):
    folder = str(tmp_path / "tied")
    hf = make_checkpoint(folder, seed=3, tie_word_embeddings=True)
    import torch

    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert "lm_head.weight" not in load_file(os.path.join(folder, "model.safetensors"))
    np.testing.assert_allclose(
        prompt_logits(Engine.from_pretrained(folder), PROMPT), want, atol=1e-4
    )
