"""Models that ship inside the package, served by name with no download.

`flipjax-py` is a Qwen3-Next hybrid trained by `python -m flipjax.train` on the Python standard
library (the README's "Training and fine-tuning" says how to reproduce it). It is the model
`make serve` serves. A shipped name stands for its folder wherever a checkpoint folder is
taken; the server still calls the model by its name.
"""

from __future__ import annotations

import os

PY_NAME = "flipjax-py"
_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped_models")
DESCRIPTIONS = {
    PY_NAME: "flipjax-py: 8.9M-parameter Qwen3-Next hybrid trained on the Python standard "
    "library (completes Python; not a chat model)",
}


def resolve(model: str) -> str:
    """The folder of a shipped model's name; any other path unchanged."""
    if model in DESCRIPTIONS:
        folder = os.path.join(_FOLDER, model)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"model: the shipped model {model!r} is missing from {_FOLDER}")
        return folder
    return model
