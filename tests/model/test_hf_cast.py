"""`python -m flipjax.ckpt cast`: a HF folder's weights in another dtype, rounded as torch
rounds them, loadable by transformers; a quantized checkpoint or an existing output is refused
and nothing is written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import Qwen3NextForCausalLM

from flipjax import ckpt
from tests.support.hf_oracle import make_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    model = make_checkpoint(folder, seed=5)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{{ messages }}"}, f)
    return folder, model


def test_cast_to_bfloat16_rounds_as_torch_does_and_keeps_the_other_files(source, tmp_path):
    folder, model = source
    out = str(tmp_path / "bf16")
    ckpt.main(["cast", folder, out, "--dtype", "bfloat16"])
    cast = Qwen3NextForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    got = dict(cast.named_parameters())
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f) == {"chat_template": "{{ messages }}"}


def test_a_quantized_checkpoint_or_an_existing_output_is_refused(source, tmp_path):
    folder, _ = source
    existing = tmp_path / "there"
    existing.mkdir()
    with pytest.raises(SystemExit, match="already exists"):
        ckpt.main(["cast", folder, str(existing), "--dtype", "bfloat16"])
    assert list(existing.iterdir()) == []
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quantized / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="compressed-tensors checkpoint"):
        ckpt.main(["cast", str(quantized), str(out), "--dtype", "float32"])
    assert not out.exists() and not (tmp_path / "out.partial").exists()
