"""The text a model is trained on: the Python standard library's own source by default, or the
files, globs, folders and JSONL files named with `--data`.

Documents come in a fixed order (sorted paths, then line order), so a run, its tokenizer and its
batches are the same on every machine with the same files. The standard library's test folders
are held out for evaluation; other corpora hold out every `HELD_OUT_EVERY`-th document.
Whatever cannot be used is refused before training starts, with the path (and line) named.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass

STDLIB = "stdlib"
# Folders of the standard library that hold its tests: held out, as unseen code to evaluate on.
TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})
# Installed packages live under the standard library's folder too; they are not part of it.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})
HELD_OUT_EVERY = 20


class CorpusError(ValueError):
    """The corpus cannot be trained on; the message names the path and the problem."""


@dataclass(frozen=True)
class Document:
    source: str  # a path, or `path:line` for a JSONL record
    text: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]
    skipped: tuple[str, ...]  # standard-library files that are not UTF-8 text


def load(specs: Iterable[str] = (STDLIB,)) -> Corpus:
    """Documents from each spec: `stdlib`, a file, a folder (its files, recursively), a glob,
    or a `.jsonl` file whose records carry a `text` string."""
    specs = list(specs) or [STDLIB]
    train: list[Document] = []
    held_out: list[Document] = []
    skipped: list[str] = []
    for spec in specs:
        if spec == STDLIB:
            docs, tests, bad = _stdlib()
            train += docs
            held_out += tests
            skipped += bad
        else:
            docs = [doc for path in _paths(spec) for doc in _read(path)]
            train += [d for i, d in enumerate(docs) if (i + 1) % HELD_OUT_EVERY]
            held_out += [d for i, d in enumerate(docs) if (i + 1) % HELD_OUT_EVERY == 0]
    if not any(d.text.strip() for d in train):
        raise CorpusError(f"corpus {', '.join(specs)}: has no text to train on")
    return Corpus(tuple(train), tuple(held_out), tuple(skipped))


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib() -> tuple[list[Document], list[Document], list[str]]:
    root = stdlib_root()
    train: list[Document] = []
    tests: list[Document] = []
    skipped: list[str] = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        folders = os.path.relpath(path, root).split(os.sep)[:-1]
        if _NOT_STDLIB.intersection(folders) or not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            skipped.append(path)  # the tests' deliberately mis-encoded files, say
            continue
        (tests if TEST_FOLDERS.intersection(folders) else train).append(Document(path, text))
    return train, tests, skipped


def _paths(spec: str) -> list[str]:
    if os.path.isdir(spec):
        found = [
            os.path.join(folder, name)
            for folder, _, names in os.walk(spec)
            for name in names
            if not name.startswith(".")
        ]
    elif os.path.exists(spec) or not glob.has_magic(spec):
        found = [spec]
    else:
        found = glob.glob(spec, recursive=True)
    found = sorted(p for p in found if not os.path.isdir(p))
    if not found:
        raise CorpusError(f"--data {spec}: matches no file")
    return found


def _read(path: str) -> list[Document]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CorpusError(f"--data {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"--data {path}: is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:
        raise CorpusError(f"--data {path}: cannot be read ({e.strerror})") from None
    if not path.endswith(".jsonl"):
        return [Document(path, text)]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"--data {path}:{number}: is not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpusError(f"--data {path}:{number}: has no 'text' string")
        docs.append(Document(f"{path}:{number}", record["text"]))
    return docs
