"""Int8 weights at load (`--quantization int8`): per-output-channel rounding, which weights
are quantized, parity with transformers running the same rounded weights, and refusals.

The oracle rounds transformers' own weights in torch (the checkpoint's `[out, in]` layout, one
scale per output row: its largest magnitude over 127), runs transformers on them, and holds
flipjax's int8 engine (the native kernels on, widening int8 as they read it) to those logits.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh

from flipjax import Engine
from flipjax.model.quantize import quantize_int8
from flipjax.model.qwen3_next import forward, init_cache
from kernels_pallas import dispatch, head_parallel
from tests.support.hf_oracle import CONFIGS, make_checkpoint
from tests.support.internals import params, parts, prompt_logits

PROMPT = [5, 17, 99, 3, 42, 7, 64, 1, 88, 23, 11, 120, 9, 33, 71, 2, 45, 60, 12, 101]
# transformers' names of the weights the policy quantizes (experts fused as [E, out, in]).
QUANTIZED = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "in_proj_qkvz.weight",
    "out_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "experts.gate_up_proj",
    "experts.down_proj",
)


def test_each_output_channel_is_rounded_to_its_own_step():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 40, 24)).astype(np.float32) * rng.uniform(0.01, 10, (3, 1, 24))
    w[1, :, 5] = 0.0  # a channel of zeros stays zeros
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (3, 24)
    assert np.all(np.abs(w - q * scale[:, None, :]) <= scale[:, None, :] / 2 * (1 + 1e-6))
    peak = np.abs(q).max(axis=1)
    assert np.all((peak == 127) | (peak == 0)) and peak[1, 5] == 0 and np.all(q[1, :, 5] == 0)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_a_weight_of_many_blocks_is_rounded_as_torch_rounds_it_whole(dtype):
    """Quantized a block of input rows at a time, exactly as the whole weight at once."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(2, 1500, 700)) * rng.uniform(0.01, 10, (2, 1, 700))
    w = jnp.asarray(w, dtype)  # 2 x 2 blocks of input rows
    q, scale = quantize_int8(np.asarray(w))
    t = torch.from_numpy(np.asarray(w, np.float32)).transpose(-1, -2)  # [E, out, in]
    want_scale = t.abs().amax(dim=-1) / 127
    want_scale = torch.where(want_scale > 0, want_scale, torch.ones_like(want_scale))
    want_q = torch.clamp(torch.round(t / want_scale[..., None]), -127, 127).to(torch.int8)
    assert np.array_equal(scale, want_scale.numpy())
    assert np.array_equal(q, want_q.transpose(-1, -2).numpy())


def _rounded(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(dim=-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(w / scale), -127, 127) * scale


@pytest.mark.parametrize("config", ["dense", "moe"])
def test_prompt_logits_match_transformers_on_the_rounded_weights(config, tmp_path):
    hf = make_checkpoint(str(tmp_path), seed=3, **CONFIGS[config])
    engine = Engine.from_pretrained(str(tmp_path), dtype="float32", quantization="int8")
    with torch.no_grad():
        full = hf(torch.tensor([PROMPT])).logits[0].numpy()
        rounded = 0
        for name, p in hf.named_parameters():
            if name.endswith(QUANTIZED):
                p.copy_(_rounded(p))
                rounded += 1
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert rounded >= 4 * 4  # every layer's projections
    got = prompt_logits(engine, PROMPT)  # XLA's dot of the widened weights
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(got - full).max() > 1e-3  # the rounding is really there
    # As a one-device stage runs it: the native kernels read the int8 weights themselves.
    cache = init_cache(engine.info.model, 1, 32, jnp.float32)
    tokens = jnp.asarray([PROMPT], jnp.int32)
    positions = jnp.arange(len(PROMPT), dtype=jnp.int32)[None]
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with dispatch.kernels("native"), head_parallel.across(one):
        step = jax.jit(forward, static_argnums=0)
        program = step.lower(parts(engine).graphdef, params(engine), tokens, positions, cache)
        logits, _ = step(parts(engine).graphdef, params(engine), tokens, positions, cache)
    assert "flipjax_matmul_int8" in program.as_text()
    np.testing.assert_allclose(np.asarray(logits[0]), want, atol=1e-4, rtol=0)


def test_the_projections_are_int8_and_the_head_router_and_gates_are_not(tmp_path):
    make_checkpoint(str(tmp_path), seed=1, **CONFIGS["moe"])
    engine = Engine.from_pretrained(str(tmp_path), quantization="int8")
    flat = nnx.to_flat_state(params(engine))
    dtypes = {".".join(map(str, k)): v.dtype for k, v in flat}
    int8 = sorted(n for n, d in dtypes.items() if d == jnp.int8)
    assert "model.layers.1.mlp.experts.gate_proj" in int8
    assert "model.layers.0.mlp.down_proj.kernel" in int8
    assert "model.layers.3.self_attn.q_proj.kernel" in int8
    assert "model.layers.1.linear_attn.in_proj_qkvz.kernel" in int8
    for kept in (
        "lm_head.kernel",
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.kernel",
        "model.layers.1.mlp.shared_expert_gate.kernel",
        "model.layers.1.linear_attn.in_proj_ba.kernel",
    ):
        assert dtypes[kept] == jnp.float32, kept
    for name in int8:  # each with its scales, in fp32
        kernel = name.endswith(".kernel")
        scale = name.removesuffix(".kernel") + ".scale" if kernel else name + "_scale"
        assert dtypes[scale] == jnp.float32, scale


def test_an_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization: 'int4' is not supported; use one of"):
        Engine.from_pretrained("tiny", quantization="int4")


@pytest.mark.parametrize(
    "qc,named",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq, 4-bit weights"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq, 4-bit weights"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "fp8, e4m3 weights"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes, 4-bit"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group"},
                        "targets": ["Linear"],
                    }
                },
            },
            r"compressed-tensors, int 4-bit weights \(group\), format pack-quantized",
        ),
    ],
)
def test_a_checkpoint_stored_quantized_is_refused_naming_its_format(qc, named, tmp_path):
    make_checkpoint(str(tmp_path), seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match=f"stored quantized \\({named}"):
        Engine.from_pretrained(str(tmp_path))
