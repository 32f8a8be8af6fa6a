"""A run's settings: the command line's flags, saved as `run.json` in the run's folder, so that
`--resume` continues with exactly the settings the run started with."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

RUN_FILE = "run.json"

# flag -> (default, type, help). A flag not given is None on the command line, so `--resume`
# can tell a flag given again (which must agree with the run's) from one left out.
SETTINGS: dict[str, tuple[Any, type, str]] = {
    "data": (["stdlib"], str, "corpus: 'stdlib', files, folders, globs or .jsonl (repeatable)"),
    "config": (None, str, "a config.json of the model to train (default: the built-in shape)"),
    "init": (None, str, "fine-tune: start from this HF checkpoint folder (and its tokenizer)"),
    "vocab_size": (4096, int, "BPE vocabulary trained on the corpus"),
    "seq_len": (256, int, "tokens per training sequence"),
    "batch_size": (16, int, "sequences per micro-batch (a multiple of the devices)"),
    "accumulate": (1, int, "micro-batches per optimizer update"),
    "steps": (2000, int, "optimizer updates"),
    "learning_rate": (3e-3, float, "peak learning rate"),
    "warmup_steps": (100, int, "updates of linear warmup before the cosine decay"),
    "weight_decay": (0.1, float, "AdamW weight decay (matrices only)"),
    "clip_norm": (1.0, float, "global gradient-norm clip"),
    "mtp_weight": (0.3, float, "weight of the MTP head's loss"),
    "eval_every": (200, int, "updates between held-out evaluations"),
    "eval_sequences": (64, int, "held-out sequences each evaluation reads"),
    "save_every": (200, int, "updates between checkpoints"),
    "devices": (0, int, "data-parallel devices (0: all)"),
    "seed": (0, int, "initialisation and data order"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, (default, kind, help) in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        shown = f"{help} (default: {default})"
        if isinstance(default, list):
            parser.add_argument(flag, action="append", type=kind, help=shown)
        else:
            parser.add_argument(flag, type=kind, help=shown)


def settings(args: argparse.Namespace, out: str, resume: bool) -> dict[str, Any]:
    """The run's settings: the saved ones on `--resume` (a flag given again must agree), else
    the flags given over the defaults."""
    given = {k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None}
    path = os.path.join(out, RUN_FILE)
    if not resume:
        return {k: given.get(k, default) for k, (default, _, _) in SETTINGS.items()}
    if not os.path.isfile(path):
        raise ValueError(f"--resume: {out} has no {RUN_FILE}; it is not a training run's folder")
    with open(path) as f:
        saved = json.load(f)
    for name, value in given.items():
        if saved.get(name) != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag}: {value!r} differs from the run's {saved.get(name)!r}; "
                "a resumed run keeps its settings"
            )
    return {k: saved.get(k, default) for k, (default, _, _) in SETTINGS.items()}


def save(out: str, values: dict[str, Any]) -> None:
    path = os.path.join(out, RUN_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(values, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
