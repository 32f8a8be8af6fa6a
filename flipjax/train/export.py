"""A trained model as a checkpoint folder: the weights with the MTP head (`hf_export`), the
run's tokenizer and its chat template, and the generation config naming the EOS."""

from __future__ import annotations

import json
import os
import shutil

from flax import nnx

from flipjax.model.hf_export import write_checkpoint
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.train import bpe


def export(folder: str, model: Qwen3NextForCausalLM, run: str) -> str:
    """Write `model` to `folder` (which must not exist), with the tokenizer files of `run`."""
    _, params = nnx.split(model, nnx.Param)

    def tokenizer_files(partial: str) -> None:
        for name in ("tokenizer.json", bpe.CONFIG_FILE):
            if os.path.isfile(os.path.join(run, name)):
                shutil.copy2(os.path.join(run, name), partial)
        with open(os.path.join(partial, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": model.cfg.eos_token_id}, f)

    return write_checkpoint(folder, params, model.cfg, tokenizer_files)
