"""The training loss against oracles we did not write: transformers' cross-entropy over its own
Qwen3NextForCausalLM, and the MTP term over transformers' decoder layer and norms wired as
reference serving code wires the head, with the cross-entropy in numpy. The exported folder is
what transformers and flipjax both load."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from transformers import Qwen3NextForCausalLM as HFModel
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_next import modeling_qwen3_next as hf_modules

from flipjax import Engine
from flipjax.model.config import ModelConfig
from flipjax.model.hf_export import write_checkpoint
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.train.loss import losses
from flipjax.train.setup import load_into
from tests.support.hf_oracle import BASE
from tests.support.internals import prompt_logits

TOKENS = np.random.default_rng(7).integers(0, BASE["vocab_size"], (2, 24)).astype(np.int32)


def perturbed_model(cfg: ModelConfig, seed: int) -> Qwen3NextForCausalLM:
    """Our model with its MTP head, every parameter moved off its initial value (norm weights
    start at 0 and 1, where a norm bug would hide)."""
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed), mtp=True)
    _, state = nnx.split(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [x + 0.08 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, moved))
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    raw = {**BASE, "model_type": "qwen3_next", "mtp_num_hidden_layers": 1}
    cfg = ModelConfig.from_hf(raw)
    model = perturbed_model(cfg, seed=3)
    folder = write_checkpoint(
        str(tmp_path_factory.mktemp("export") / "hf"), nnx.split(model)[1], cfg
    )
    return model, folder, HFModel.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_next_token_loss_is_transformers_cross_entropy(exported):
    model, _, hf = exported
    mask = np.ones_like(TOKENS, bool)
    mask[1, 19:] = False  # a padded row: its tail has no loss
    ours = losses(model, jnp.asarray(TOKENS), jnp.asarray(mask), mtp_weight=0.0)
    labels = torch.tensor(np.where(mask, TOKENS, -100), dtype=torch.long)
    with torch.no_grad():
        want = hf(torch.tensor(TOKENS, dtype=torch.long), labels=labels).loss.item()
    assert abs(float(ours.next_token) - want) < 1e-4
    assert int(ours.tokens) == mask[:, 1:].sum()
    assert float(ours.total) == pytest.approx(float(ours.next_token))


def _mtp_oracle(hf: HFModel, folder: str) -> np.ndarray:
    """Logits for t+2 at each t, from transformers' modules: fc over [norm(embed(t+1)),
    norm(hidden(t))], a full-attention decoder layer at position t, the final norm, the head."""
    cfg = hf.config
    tensors = {
        k.removeprefix("mtp."): torch.from_numpy(v)
        for k, v in load_file(f"{folder}/model.safetensors").items()
        if k.startswith("mtp.")
    }
    full = cfg.layer_types.index("full_attention")
    layer = hf_modules.Qwen3NextDecoderLayer(cfg, full).eval()
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")}
    )
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hf_modules.Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": tensors[f"{name}.weight"]})
    tokens = torch.tensor(TOKENS, dtype=torch.long)
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state[:, :-1]
        embeds = hf.model.embed_tokens(tokens[:, 1:])
        x = torch.cat(
            [norms["pre_fc_norm_embedding"](embeds), norms["pre_fc_norm_hidden"](hidden)], -1
        )
        x = x @ tensors["fc.weight"].T
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        mask = create_causal_mask(
            config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
        )
        x = layer(
            x,
            position_embeddings=hf.model.rotary_emb(x, positions),
            attention_mask=mask,
            position_ids=positions,
        )
        return hf.lm_head(norms["norm"](x)).numpy()


def test_the_mtp_loss_is_the_reference_heads_cross_entropy_on_t_plus_2(exported):
    model, folder, hf = exported
    logits = _mtp_oracle(hf, folder)[:, :-1]  # at t = 0 .. T-3, for tokens 2 .. T-1
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, TOKENS[:, 2:, None], -1).mean()
    mask = jnp.ones(TOKENS.shape, bool)
    ours = losses(model, jnp.asarray(TOKENS), mask, mtp_weight=0.5)
    assert abs(float(ours.mtp) - want) < 1e-4
    assert float(ours.total) == pytest.approx(float(ours.next_token) + 0.5 * float(ours.mtp))


def test_the_exported_folder_gives_transformers_and_flipjax_the_same_logits(exported):
    model, folder, hf = exported
    prompt = [int(t) for t in TOKENS[0]]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(
        prompt_logits(Engine.from_pretrained(folder), prompt), want, atol=1e-4, rtol=0
    )
    # The head comes back with the model when it is asked for, exactly as exported.
    cfg = ModelConfig.from_hf(folder)
    assert cfg.mtp_num_hidden_layers == 1
    again = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), mtp=True)
    load_into(again, folder, cfg)
    exported_params = nnx.to_flat_state(nnx.split(model, nnx.Param)[1])
    loaded = nnx.to_flat_state(nnx.split(again, nnx.Param)[1])
    for (path, a), (_, b) in zip(exported_params, loaded, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_a_config_without_mtp_layers_has_no_head():
    cfg = dataclasses.replace(ModelConfig.from_hf({**BASE, "model_type": "qwen3_next"}))
    assert cfg.mtp_num_hidden_layers == 0
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), mtp=True)


def test_an_export_that_fails_leaves_no_folder_and_one_never_overwrites(exported, tmp_path):
    model, folder, _ = exported
    params = nnx.split(model, nnx.Param)[1]

    def broken(partial: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(str(tmp_path / "out"), params, model.cfg, broken)
    assert sorted(os.listdir(tmp_path)) == []
    before = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileExistsError, match="already exists"):
        write_checkpoint(folder, params, model.cfg)
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == before
