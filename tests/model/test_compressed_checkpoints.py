"""Checkpoints stored int8 in the compressed-tensors format (as llm-compressor writes them) load
with their weights still int8, and give the logits and tokens transformers gives loading the
same folder through compressed-tensors; schemes flipjax does not run are refused by name.

W8A16 (`pack-quantized`) is held to transformers within fp32 rounding. W8A8 (`int-quantized`)
rounds each token's activations to int8 on the fly, a step function: a last-bit difference in
an activation (another summation order) can move it a whole step, and a GDN state carries that
to every later token. Its first token is held to fp32 rounding, the rest to an average far
closer than the same weights without the activation rounding; the rounding itself is checked
bit for bit against compressed-tensors' own.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3NextForCausalLM

from flipjax import Engine
from tests.support.compressed import dequantized, int8_checkpoint, quantize_experts
from tests.support.hf_oracle import CONFIGS, make_checkpoint
from tests.support.internals import params, prompt_logits

PROMPT = [5, 17, 99, 3, 42, 7, 64, 1, 88, 23, 11, 120, 9, 33, 71, 2, 45, 60, 12, 101]


def _reference(folder: str) -> tuple[np.ndarray, list[int]]:
    hf = Qwen3NextForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    return logits, out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("fmt,activations", [("pack-quantized", False), ("int-quantized", True)])
def test_an_int8_checkpoint_gives_transformers_logits_and_tokens(fmt, activations, tmp_path):
    int8_checkpoint(str(tmp_path), fmt, activations)
    want_logits, want_tokens = _reference(str(tmp_path))
    engine = Engine.from_pretrained(str(tmp_path))
    flat = nnx.to_flat_state(params(engine))
    dtypes = {".".join(map(str, k)): v.dtype for k, v in flat}
    assert dtypes["model.layers.0.linear_attn.in_proj_qkvz.kernel"] == jnp.int8
    assert dtypes["model.layers.3.self_attn.o_proj.scale"] == jnp.float32
    assert dtypes["model.layers.0.linear_attn.in_proj_ba.kernel"] == jnp.float32
    got = prompt_logits(engine, PROMPT)
    if not activations:
        np.testing.assert_allclose(got, want_logits, atol=1e-4, rtol=0)
        assert engine.generate([PROMPT], max_new_tokens=8)[0].token_ids == want_tokens
        return
    # W8A8: the first token's logits before any rounding step could flip, and on average
    # (the same weights without the activation rounding: 0.07 at the first token, 0.027 on
    # average).
    np.testing.assert_allclose(got[0], want_logits[0], atol=1e-4, rtol=0)
    assert np.abs(got - want_logits).mean() < 0.015


@pytest.mark.parametrize(
    "fmt,weights,named",
    [
        ("pack-quantized", dict(strategy="group", group_size=32), r"int 8-bit weights \(group\)"),
        ("pack-quantized", dict(num_bits=4), r"int 4-bit weights \(channel\)"),
        ("int-quantized", dict(symmetric=False), r"int 8-bit weights \(channel\)"),
    ],
)
def test_other_compressed_schemes_are_refused_by_name(fmt, weights, named, tmp_path):
    int8_checkpoint(str(tmp_path), fmt, False, weights=weights)
    with pytest.raises(ValueError, match=f"stored quantized \\(compressed-tensors, {named}"):
        Engine.from_pretrained(str(tmp_path))


def test_an_int8_weight_without_int8_values_is_refused(tmp_path):
    int8_checkpoint(str(tmp_path), "int-quantized", False)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.3.self_attn.q_proj.weight"
    tensors[name] = tensors[name].astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}: has a weight_scale but is float32, not int8"):
        Engine.from_pretrained(str(tmp_path))


def test_token_rounding_is_compressed_tensors_own_bit_for_bit():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from kernels_pallas.matmul.token_rounding import round_tokens_to_int8

    args = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    x = torch.randn(1, 64, 256) * torch.rand(1, 64, 1) * 10
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Identity())
    want = fake_quantize(x, scale, zero, args).numpy()
    got = np.asarray(round_tokens_to_int8(jnp.asarray(x.numpy())))
    np.testing.assert_array_equal(got, want)


def test_int8_experts_stay_int8_and_give_the_dequantized_models_logits(tmp_path):
    """A mixture-of-experts checkpoint with every expert stored int8, as llm-compressor writes
    one. transformers does not load such a folder, so the oracle is transformers' model with
    every int8 weight replaced by its values times its scales."""
    hf = make_checkpoint(str(tmp_path / "full"), seed=5, **CONFIGS["moe"])
    int8_checkpoint(str(tmp_path), "int-quantized", False, seed=5, **CONFIGS["moe"])
    quantize_experts(str(tmp_path))
    weights = dequantized(str(tmp_path))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                prefix, fused = name.rsplit(".", 1)
                per = [
                    torch.cat([weights[f"{prefix}.{e}.{proj}.weight"] for proj in projs])
                    for e in range(p.shape[0])
                    for projs in [("gate_proj", "up_proj") if fused == "gate_up_proj" else (fused,)]
                ]
                p.copy_(torch.stack(per))
            else:
                p.copy_(weights[name])
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    engine = Engine.from_pretrained(str(tmp_path))
    flat = nnx.to_flat_state(params(engine))
    dtypes = {".".join(map(str, k)): v.dtype for k, v in flat}
    assert dtypes["model.layers.1.mlp.experts.down_proj"] == jnp.int8
    assert dtypes["model.layers.1.mlp.experts.down_proj_scale"] == jnp.float32
    np.testing.assert_allclose(prompt_logits(engine, PROMPT), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("stored", ["experts", "projections"])
def test_quantizing_at_load_keeps_the_scales_a_checkpoint_stored(stored, tmp_path):
    """Some weights stored int8 and `quantization="int8"`: the stored ones keep their values
    and scales, and only the weights stored in full precision are quantized."""
    if stored == "experts":
        make_checkpoint(str(tmp_path), seed=5, **CONFIGS["moe"])
        quantize_experts(str(tmp_path))
    else:
        int8_checkpoint(str(tmp_path), "int-quantized", False, seed=5, **CONFIGS["moe"])
    weights = dequantized(str(tmp_path))
    engine = Engine.from_pretrained(str(tmp_path), quantization="int8")
    leaves = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(params(engine))}
    assert leaves["model.layers.3.self_attn.q_proj.kernel"].dtype == jnp.int8
    assert leaves["model.layers.1.mlp.experts.down_proj"].dtype == jnp.int8
    if stored == "experts":
        q = np.asarray(leaves["model.layers.1.mlp.experts.down_proj"], np.float32)[2]
        scale = np.asarray(leaves["model.layers.1.mlp.experts.down_proj_scale"])[2]
        want = weights["model.layers.1.mlp.experts.2.down_proj.weight"].numpy().T
    else:
        q = np.asarray(leaves["model.layers.3.self_attn.q_proj.kernel"], np.float32)
        scale = np.asarray(leaves["model.layers.3.self_attn.q_proj.scale"])
        want = weights["model.layers.3.self_attn.q_proj.weight"].numpy().T
    np.testing.assert_array_equal(q * scale, want)


def test_w8a8_with_other_activation_scales_is_refused_by_name(tmp_path):
    int8_checkpoint(str(tmp_path), "int-quantized", True)
    config = json.loads((tmp_path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"]["strategy"] = "tensor"  # one scale for a whole batch
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"int 8-bit activations \(tensor\)"):
        Engine.from_pretrained(str(tmp_path))


def test_a_packed_weight_stating_a_shape_its_words_cannot_hold_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    int8_checkpoint(str(tmp_path), "pack-quantized", False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.3.self_attn.q_proj.weight_shape"
    tensors[name] = np.asarray([1 << 20, 1 << 20], tensors[name].dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_shape \[1048576, 1048576\] does not fit"):
        Engine.from_pretrained(str(tmp_path))
