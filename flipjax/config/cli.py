"""The command line, generated from the config tree: one argument group per concern, each
flag's type, default, choices and help read from its field (as vLLM's `EngineArgs` feeds its
parser), and the parsed flags read back into a `FlipjaxConfig`.

Light on imports: `--help` and the log set-up run before the server's modules load.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import Field
from typing import Any

from flipjax.config.option import flag_of
from flipjax.config.tree import FlipjaxConfig

_TITLES = {
    "model": "model",
    "engine": "pools and batching",
    "cache": "prefix cache",
    "layout": "layouts and flips",
    "speculative": "speculative decoding",
    "store": "KV store",
    "serve": "HTTP server, access and limits",
    "distributed": "multi-process (jax.distributed)",
}


def add_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One argument group per concern of `FlipjaxConfig` (or of those in `only`), one flag per
    field."""
    for concern in dataclasses.fields(FlipjaxConfig):
        if only is not None and concern.name not in only:
            continue
        cls = concern.default_factory  # type: ignore[misc]
        group = parser.add_argument_group(_TITLES[concern.name])
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add(group, f, hints[f.name])


def from_namespace(args: argparse.Namespace) -> FlipjaxConfig:
    """The tree the parsed flags describe (the defaults for concerns without flags); a bad
    value is a ValueError naming its field."""
    options = {}
    for concern in dataclasses.fields(FlipjaxConfig):
        cls = concern.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name):
                options[f.name] = _to_field(f, hints[f.name], getattr(args, f.name))
    return FlipjaxConfig.build(**options)


def parse(argv: list[str] | None, prog: str, description: str | None) -> FlipjaxConfig:
    """Parse `argv` into a tree; a value the tree refuses is a usage error naming the flag."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return from_namespace(args)
    except ValueError as err:
        parser.error(str(err))
        raise  # parser.error exits; this keeps type checkers honest


def _add(group: argparse._ArgumentGroup, f: Field[Any], hint: Any) -> None:
    meta, flag = f.metadata, flag_of(f)
    kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
    base, _ = _unwrap(hint)
    if base is bool:
        group.add_argument(flag, action="store_true", **kwargs)
        return
    # Named after the flag, not the field: a flag in another unit says so.
    if not meta.get("choices"):  # argparse lists the choices instead
        kwargs["metavar"] = meta.get("metavar") or flag.removeprefix("--").replace("-", "_").upper()
    default = f.default
    if meta.get("env"):
        default = os.environ.get(meta["env"], default)
    if meta.get("unit") and default is not None:
        default = default / meta["unit"]
    if f.default is not None and f.default != () and "default" not in kwargs["help"]:
        shown = f.default / meta["unit"] if meta.get("unit") else f.default
        kwargs["help"] += (
            f" (default: {shown:g})" if isinstance(shown, float) else (f" (default: {shown})")
        )
    if typing.get_origin(base) is tuple:
        if f.default is None:  # a list given once
            kwargs["nargs"] = "+"
        else:  # a tuple with a default: the flag repeats
            kwargs["action"] = "append"
            default = None
        base = str
    elif meta.get("unit"):
        base = float
    kwargs.update(type=base, default=default)
    if meta.get("choices"):
        kwargs["choices"] = meta["choices"]
    group.add_argument(flag, **kwargs)


def _to_field(f: Field[Any], hint: Any, value: Any) -> Any:
    meta = f.metadata
    if meta.get("negate"):
        return not value
    if value is None:  # a repeatable flag never given keeps its default
        return f.default
    if isinstance(value, list):
        return tuple(value)
    if meta.get("unit"):
        scaled = value * meta["unit"]
        return int(scaled) if _unwrap(hint)[0] is int else scaled
    return value


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (hint, False)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False
