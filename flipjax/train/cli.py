"""`python -m flipjax.train OUT`: train (or fine-tune) a Qwen3-Next model with the modules the
engine serves, and export it as a checkpoint folder `python -m flipjax.serve --model` takes.

    python -m flipjax.train runs/py                     the Python standard library, from scratch
    python -m flipjax.train runs/py --resume            on from the run's last checkpoint
    python -m flipjax.train runs/mine --init runs/py/hf --data 'notes/*.md'     fine-tune

OUT holds the run: `run.json` (its settings), the tokenizer, `checkpoints/` (orbax) and, when
the run is done, `hf/` (config.json, model.safetensors with the MTP head, the tokenizer).
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    from flipjax.train import run_config

    parser = argparse.ArgumentParser(
        prog="python -m flipjax.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", help="the run's folder")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    run_config.add_arguments(parser)
    args = parser.parse_args(argv)
    from flipjax.train.corpus import CorpusError
    from flipjax.train.loop import TrainingDiverged

    try:
        return _run(args)
    except (CorpusError, ValueError, FileExistsError, OSError) as e:
        print(f"python -m flipjax.train: error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"python -m flipjax.train: stopped: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from flipjax.train import run_config

    out = os.path.abspath(args.out)
    if not args.resume and os.path.isdir(os.path.join(out, "checkpoints")):
        raise FileExistsError(f"{out}: holds a run already; --resume it or choose a new folder")
    values = run_config.settings(args, out, args.resume)
    os.makedirs(out, exist_ok=True)

    import jax
    import numpy as np
    from flax import nnx

    from flipjax.train import bpe, setup
    from flipjax.train.batches import Batches, DataPosition, eval_sequences
    from flipjax.train.checkpoints import TrainCheckpoints
    from flipjax.train.export import export
    from flipjax.train.loop import LoopSettings, evaluate, train
    from flipjax.train.optimizer import OptimizerConfig, make_optimizer
    from flipjax.train.step import Trainer, data_mesh

    optimizer_config = OptimizerConfig(
        steps=values["steps"],
        learning_rate=values["learning_rate"],
        warmup_steps=values["warmup_steps"],
        weight_decay=values["weight_decay"],
        clip_norm=values["clip_norm"],
        accumulate=values["accumulate"],
    )
    devices = jax.devices()
    count = values["devices"] or len(devices)
    if not 1 <= count <= len(devices) or values["batch_size"] % count:
        raise ValueError(
            f"--devices {count}: must be 1..{len(devices)} and divide --batch-size "
            f"{values['batch_size']}"
        )
    # The MTP loss needs tokens t, t+1 and t+2 in a sequence.
    for name, least in (
        ("seq_len", 3),
        ("eval_every", 1),
        ("save_every", 1),
        ("eval_sequences", 1),
    ):
        if values[name] < least:
            raise ValueError(f"--{name.replace('_', '-')}: {values[name]} is below {least}")
    prepared = setup.prepare(out, values)
    batches = Batches(
        prepared.train_stream, values["seq_len"], values["batch_size"], values["seed"]
    )
    held_out = eval_sequences(prepared.held_out_stream, values["seq_len"], values["eval_sequences"])
    run_config.save(out, values)

    graphdef, params = nnx.split(prepared.model, nnx.Param)
    trainer = Trainer(
        graphdef, make_optimizer(optimizer_config), data_mesh(devices[:count]), values["mtp_weight"]
    )
    params = trainer.place(params)
    opt_state = trainer.init_optimizer(params)
    checkpoints = TrainCheckpoints(os.path.join(out, "checkpoints"))
    start, position = 0, DataPosition()
    latest = checkpoints.latest_step()
    if args.resume and latest is not None:
        params, opt_state, position = checkpoints.restore(latest, params, opt_state)
        start = latest
    byte_lengths = np.asarray(bpe.token_byte_lengths(prepared.tokenizer))
    evaluation = None
    if len(held_out) >= values["batch_size"]:
        evaluation = lambda p: evaluate(trainer, p, held_out, byte_lengths, values["batch_size"])  # noqa: E731
    parameters = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"training {parameters / 1e6:.2f}M parameters on {count} device(s): "
        f"{len(batches.sequences)} sequences of {values['seq_len']} tokens "
        f"({batches.per_epoch} batches an epoch), {len(held_out)} held out"
        + (f"; {prepared.skipped} non-UTF-8 files skipped" if prepared.skipped else ""),
        file=sys.stderr,
    )
    loop = LoopSettings(
        values["steps"],
        values["accumulate"],
        values["save_every"],
        values["eval_every"],
        progress=not args.no_progress,
    )
    params, opt_state, step, stopped = train(
        trainer, params, opt_state, batches, position, start, loop, checkpoints, evaluation
    )
    checkpoints.close()
    if stopped is not None:
        print(
            f"{stopped}: stopped at step {step}, checkpoint saved; --resume goes on",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if evaluation is not None and (step // values["accumulate"]) % values["eval_every"]:
        print(evaluation(params).line(step // values["accumulate"]), file=sys.stderr)
    folder = os.path.join(out, "hf")
    if not os.path.exists(folder):
        export(folder, nnx.merge(graphdef, params), out)
        print(f"exported {folder}", file=sys.stderr)
    return 0
