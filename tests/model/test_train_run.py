"""`python -m flipjax.train` end to end on a small model and corpus: the loss falls, a run
interrupted and resumed equals one that was not, eight data-parallel devices equal one, a
non-finite loss stops the run by name, and bad input is refused before the first step."""

from __future__ import annotations

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from flipjax.model.config import ModelConfig
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.train import cli
from flipjax.train.corpus import stdlib_root
from flipjax.train.optimizer import OptimizerConfig, make_optimizer
from flipjax.train.step import Trainer, data_mesh
from tests.support.hf_oracle import BASE

# Two layers, one of each kind: compiling the forward and backward is most of these tests' time.
SMALL = {
    **BASE,
    "model_type": "qwen3_next",
    "vocab_size": 512,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "mlp_only_layers": [0, 1],
    "mtp_num_hidden_layers": 1,
}
FLAGS = ["--vocab-size", "512", "--seq-len", "32", "--batch-size", "8", "--no-progress"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A JSONL corpus of 60 records cut from three standard-library modules, and the small
    model's config."""
    folder = tmp_path_factory.mktemp("inputs")
    stdlib = stdlib_root()
    text = "".join(open(os.path.join(stdlib, m)).read() for m in ("textwrap.py", "shlex.py"))
    lines = text.splitlines(keepends=True)
    records = ["".join(lines[i::60]) for i in range(60)]
    with open(folder / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": r}) + "\n" for r in records)
    with open(folder / "config.json", "w") as f:
        json.dump(SMALL, f)
    return {"data": str(folder / "corpus.jsonl"), "config": str(folder / "config.json")}


def _args(inputs: dict[str, str], out, *extra: str) -> list[str]:
    return [str(out), "--data", inputs["data"], "--config", inputs["config"], *FLAGS, *extra]


def _small_trainer(devices: int, learning_rate: float = 1e-2) -> tuple[Trainer, nnx.State]:
    cfg = ModelConfig.from_hf(SMALL)
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), mtp=True)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(OptimizerConfig(steps=20, learning_rate=learning_rate,
                                               warmup_steps=2))  # fmt: skip
    trainer = Trainer(graphdef, optimizer, data_mesh(jax.devices()[:devices]), mtp_weight=0.3)
    return trainer, trainer.place(params)


def test_steps_on_one_batch_drive_its_loss_down():
    trainer, params = _small_trainer(1)
    opt_state = trainer.init_optimizer(params)
    batch = trainer.batch(np.random.default_rng(0).integers(0, 512, (8, 32)))
    seen = []
    for _ in range(20):
        params, opt_state, metrics = trainer.step(params, opt_state, batch)
        seen.append((float(metrics.losses.next_token), float(metrics.losses.mtp)))
    assert seen[-1][0] < 0.5 * seen[0][0] and seen[-1][1] < 0.7 * seen[0][1], seen


def test_eight_data_parallel_devices_equal_one():
    """The loss and its gradient within 1e-5, and the losses of three updates after. (Parameters
    are not compared element by element: AdamW divides each gradient by its own running size,
    so a gradient near zero moves its parameter by a learning rate whatever its rounding.)"""
    batch = np.random.default_rng(1).integers(0, 512, (8, 32))
    runs = []
    for devices in (1, 8):
        trainer, params = _small_trainer(devices)
        tokens = trainer.batch(batch)
        assert len(tokens.sharding.device_set) == devices
        terms, grads = trainer.gradients(params, tokens)
        opt_state = trainer.init_optimizer(params)
        losses = []
        for _ in range(3):
            params, opt_state, metrics = trainer.step(params, opt_state, tokens)
            losses.append(float(metrics.losses.total))
        runs.append((float(terms.total), jax.device_get(grads), losses))
    (loss_1, grads_1, losses_1), (loss_8, grads_8, losses_8) = runs
    assert abs(loss_1 - loss_8) < 1e-5
    np.testing.assert_allclose(losses_1, losses_8, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads_8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _weights(run) -> dict[str, np.ndarray]:
    return load_file(str(run / "hf" / "model.safetensors"))


STEPS = ["--steps", "4", "--save-every", "100", "--eval-every", "2"]


@pytest.fixture(scope="module")
def straight(inputs, tmp_path_factory):
    """A run of four updates, uninterrupted."""
    run = tmp_path_factory.mktemp("straight")
    assert cli.main(_args(inputs, run, *STEPS)) == 0
    return run


def test_a_run_interrupted_and_resumed_equals_the_uninterrupted_run(
    inputs, straight, tmp_path, monkeypatch
):
    step = Trainer.step
    calls = []

    def interrupted_at_the_second(self, *args):
        calls.append(1)
        if len(calls) == 2:  # as Ctrl-C would, while the step runs
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, *args)

    monkeypatch.setattr(Trainer, "step", interrupted_at_the_second)
    run = tmp_path / "resumed"
    assert cli.main(_args(inputs, run, *STEPS)) == cli.EXIT_INTERRUPTED
    assert sorted(os.listdir(run / "checkpoints")) == ["2"] and not (run / "hf").exists()
    monkeypatch.setattr(Trainer, "step", step)
    assert cli.main([str(run), "--resume", "--steps", "5"]) == 2  # not the run's settings
    assert cli.main([str(run), "--resume", "--no-progress"]) == 0
    want, got = _weights(straight), _weights(run)
    assert sorted(want) == sorted(got) and any(k.startswith("mtp.") for k in got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_fine_tuning_starts_from_the_checkpoint_and_keeps_its_tokenizer(inputs, straight, tmp_path):
    """An update of 1e-12 leaves every weight, the MTP head's too, where the checkpoint had it."""
    run = tmp_path / "tuned"
    flags = ["--data", inputs["data"], *FLAGS, "--init", str(straight / "hf")]
    tiny_step = ["--steps", "1", "--learning-rate", "1e-12", "--warmup-steps", "0"]
    assert cli.main([str(run), *flags, *tiny_step]) == 0
    want, got = _weights(straight), _weights(run)
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-9, rtol=0, err_msg=name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (run / "hf" / name).read_bytes() == (straight / "hf" / name).read_bytes()


def test_a_non_finite_loss_stops_the_run_by_step_and_batch(inputs, tmp_path, capsys):
    run = tmp_path / "diverged"
    flags = ["--learning-rate", "1e30", "--warmup-steps", "0", "--save-every", "1", "--steps", "5"]
    assert cli.main(_args(inputs, run, *flags)) == 1
    err = capsys.readouterr().err
    assert "step 2: the loss is" in err and "epoch 0, sequences 8..15" in err, err
    assert sorted(os.listdir(run / "checkpoints")) == ["1"]  # none of the non-finite step


@pytest.mark.parametrize(
    "case,problem",
    [
        ("missing", "no such file"),
        ("empty", "has no text to train on"),
        ("latin1", "is not UTF-8 text"),
        ("no_text", "corpus.jsonl:2: has no 'text' string"),
        ("small_vocab", "vocab_size 128 is smaller than the tokenizer's 512"),
        ("long_sequences", "--seq-len: 1024 is past the config's max_position_embeddings 512"),
        ("uneven_batch", "--devices 3: must be 1..8 and divide --batch-size 8"),
        ("not_a_run", "has no run.json"),
    ],
)
def test_bad_input_is_refused_before_the_first_step(inputs, tmp_path, capsys, case, problem):
    data, config, extra = inputs["data"], inputs["config"], []
    if case == "missing":
        data = str(tmp_path / "nowhere.txt")
    elif case in ("empty", "latin1", "no_text"):
        data = str(tmp_path / ("corpus.jsonl" if case == "no_text" else "corpus.txt"))
        content = {"empty": b" \n", "latin1": "caf\xe9".encode("latin-1"),
                   "no_text": b'{"text": "a"}\n{"body": "b"}\n'}[case]  # fmt: skip
        open(data, "wb").write(content)
    elif case == "small_vocab":
        config = str(tmp_path / "config.json")
        json.dump({**SMALL, "vocab_size": 128}, open(config, "w"))
    elif case == "long_sequences":
        extra = ["--seq-len", "1024"]
    elif case == "uneven_batch":
        extra = ["--devices", "3"]
    out = tmp_path / "run"
    argv = [str(out), "--data", data, "--config", config, *FLAGS, *extra]
    if case == "not_a_run":
        argv = [str(out), "--resume"]
    assert cli.main(argv) == 2
    assert problem in capsys.readouterr().err
    assert not (out / "checkpoints").exists()
