"""`python -m flipjax.train.report MODEL`: what a trained checkpoint folder is worth, on the
held-out split of its corpus (`python -m flipjax.train`'s split, the standard library's test
folders by default):

- held-out loss and bits per byte, beside the order-4 byte n-gram baseline (`ngram`) fitted on
  the training documents and scored on the very bytes the model was scored on;
- how often the MTP head's greedy t+2 equals the model's own greedy t+2;
- of held-out function signatures, how many have a greedy completion (through the serving
  engine) whose body parses with `ast.parse`.
"""

from __future__ import annotations

import argparse
import ast
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer

from flipjax.engine.engine import Engine
from flipjax.model.config import ModelConfig
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.shipped import resolve
from flipjax.train import bpe, corpus, ngram
from flipjax.train.batches import eval_sequences, token_stream
from flipjax.train.loop import evaluate
from flipjax.train.setup import TOKENIZER_FILE, load_into
from flipjax.train.step import Trainer, data_mesh

SIGNATURES = 20
COMPLETION_TOKENS = 256


@dataclass(frozen=True)
class Signature:
    source: str  # `path:line` of the `def`
    # The header, dedented to column 0, ending at its colon: the newline and the body's indent
    # are the model's to write (a byte-level BPE merges them into one token, so a prompt that
    # ends in a bare newline is one the model has seldom seen followed by an indented line).
    text: str


def held_out_signatures(docs: Sequence[corpus.Document], count: int) -> list[Signature]:
    """`count` function headers spread evenly over every one the documents define (in document
    and line order); a header on one line with its body is left out."""
    found: list[tuple[str, int, str]] = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        lines = doc.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            first_body = node.body[0].lineno
            if first_body <= node.lineno:
                continue
            header = textwrap.dedent("".join(lines[node.lineno - 1 : first_body - 1])).rstrip()
            if header.endswith(":"):
                found.append((doc.source, node.lineno, header))
    found.sort(key=lambda f: f[:2])
    if len(found) < count:
        raise ValueError(f"held-out text: {len(found)} function headers, fewer than {count}")
    chosen = [found[(i * len(found)) // count] for i in range(count)]
    return [Signature(f"{source}:{line}", header) for source, line, header in chosen]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def function_source(signature: Signature, completion: str, finished: bool) -> tuple[str, str]:
    """(header, body) of the function a completion writes: the header line as completed, then
    the block the body opens, up to the first line indented less than its first (the header is
    shown at column 0, so a method's body may come at any depth: a model that knows `self`
    writes it where the method's own would go), less a last line cut off by the token limit
    (`finished` False)."""
    header_lines = signature.text.count("\n") + 1
    lines = (signature.text + completion).split("\n")
    if not finished:
        lines = lines[:-1]
    body: list[str] = []
    depth = None
    for line in lines[header_lines:]:
        if line.strip():
            depth = _indent(line) if depth is None else depth
            if depth == 0 or _indent(line) < depth:
                break
        body.append(line)
    return "\n".join(lines[:header_lines]), "\n".join(body).rstrip()


def parses(signature: Signature, completion: str, finished: bool) -> bool:
    """Whether the completion gives the header an indented body that `ast.parse` accepts (the
    body re-indented one level under the header)."""
    header, body = function_source(signature, completion, finished)
    if not body.strip():
        return False
    try:
        ast.parse(header + "\n" + textwrap.indent(textwrap.dedent(body), "    ") + "\n")
    except (SyntaxError, ValueError):
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flipjax.train.report", description=__doc__)
    parser.add_argument("model", help="a folder python -m flipjax.train wrote, or 'flipjax-py'")
    parser.add_argument("--data", action="append", help="as `python -m flipjax.train --data`")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=512, help="held-out sequences scored")
    parser.add_argument("--signatures", type=int, default=SIGNATURES)
    args = parser.parse_args(argv)
    folder = resolve(args.model)
    texts = corpus.load(args.data or [corpus.STDLIB])
    scores = _scores(folder, texts, args.seq_len, args.sequences)
    for line in scores:
        print(line)
    signatures = held_out_signatures(texts.held_out, args.signatures)
    ok = _parsing_completions(folder, signatures)
    print(
        f"greedy completions of {len(signatures)} held-out function signatures whose body "
        f"parses: {sum(ok)} ({sum(ok) / len(signatures):.0%})"
    )
    root = corpus.stdlib_root() + os.sep
    for signature, good in zip(signatures, ok, strict=True):
        where = signature.source.removeprefix(root)
        print(
            f"  {'parses' if good else 'fails '}  {where}: {signature.text.splitlines()[0].strip()}"
        )


def _scores(model: str, texts: corpus.Corpus, seq_len: int, count: int) -> list[str]:
    tokenizer = Tokenizer.from_file(f"{model}/{TOKENIZER_FILE}")
    eos = bpe.eos_id(tokenizer)
    sequences = eval_sequences(token_stream(tokenizer, texts.held_out, eos), seq_len, count)
    cfg = ModelConfig.from_hf(model)
    net = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), mtp=True)
    load_into(net, model, cfg)
    graphdef, params = nnx.split(net, nnx.Param)
    trainer = Trainer(graphdef, optax.identity(), data_mesh(jax.devices()[:1]), 0.0)
    batch = min(16, len(sequences))
    scored = evaluate(
        trainer,
        trainer.place(params),
        sequences,
        np.asarray(bpe.token_byte_lengths(tokenizer)),
        batch,
    )
    used = sequences[: (len(sequences) // batch) * batch]
    text = b"\n".join(tokenizer.decode(row.tolist()).encode() for row in used)
    baseline = ngram.ByteNgram(ngram.bytes_of(texts.train)).bits_per_byte(
        np.frombuffer(text, np.uint8).astype(np.int64)
    )
    return [
        f"held-out: {len(used)} sequences of {seq_len} tokens ({len(text):,} bytes)",
        f"  loss {scored.loss:.4f} nats/token, {scored.bits_per_byte:.4f} bits/byte "
        f"(order-{ngram.ORDER} byte n-gram on the same bytes: {baseline:.4f} bits/byte)",
        f"  MTP head: loss {scored.mtp_loss:.4f}, its greedy t+2 equals the model's on "
        f"{scored.mtp_agreement:.1%} of positions",
    ]


def _parsing_completions(model: str, signatures: Sequence[Signature]) -> list[bool]:
    engine = Engine.from_pretrained(model, dtype="float32")
    outputs = engine.generate([s.text for s in signatures], max_new_tokens=COMPLETION_TOKENS)
    return [
        parses(s, out.text, out.finish_reason == "stop")
        for s, out in zip(signatures, outputs, strict=True)
    ]


if __name__ == "__main__":
    main()
