"""The engines the speculative-decoding tests compare: the shipped model (it has a trained MTP
head), with and without drafting, and prompts it continues in kind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from flipjax import Engine
from flipjax.model.shipped import resolve

MODEL = "flipjax-py"
OPTIONS: dict[str, Any] = dict(
    dtype="float32", num_pages=160, max_running_requests=8, max_prefill_tokens=256, warmup=False
)
PROMPTS = [
    "import os\n\n\ndef read_lines(path):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    ",
    "for i in range(10):\n    if",
    "import json\n\n\ndef load(path):\n    with open(path) as f:",
    "def is_prime(n):",
]


def speculative(num_steps: int = 3, **options: Any) -> Engine:
    """The shipped model drafting `num_steps` tokens a step with its MTP head, in every step
    unless `speculative_adaptive` lets it measure which way is faster."""
    options = {"model": MODEL, "speculative_adaptive": False, **OPTIONS, **options}
    return Engine.from_pretrained(
        options.pop("model"),
        speculative_algorithm="MTP",
        speculative_num_steps=num_steps,
        **options,
    )


def plain(**options: Any) -> Engine:
    return Engine.from_pretrained(MODEL, **(OPTIONS | options))


def untied_copy(folder: Path) -> str:
    """The shipped model with its lm head a tensor of its own (a copy of the embedding: the
    same model), which a pipeline can place on its last stage."""
    shutil.copytree(resolve(MODEL), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return str(folder)
