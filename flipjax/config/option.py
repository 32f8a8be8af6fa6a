"""`option`: a config field that carries what its command-line flag needs.

A field's name is its keyword in `FlipjaxConfig.build` and `Engine.from_pretrained`; its flag is
`--field-name` unless the flag users already know is spelled otherwise (sglang's and vLLM's
names win). `unit` converts a flag given in a friendlier unit (GiB, milliseconds) into the
field's; `negate` makes a True-by-default field a `--disable-...` switch; `env` names an environment
variable the flag defaults to (a secret kept out of `ps`); a `secret` is never logged.
"""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    unit: float | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    negate: bool = False,
    env: str | None = None,
    secret: bool = False,
) -> Any:
    """A dataclass field with its flag's description in `metadata`."""
    meta = {
        "help": help,
        "flag": flag,
        "unit": unit,
        "choices": choices,
        "metavar": metavar,
        "negate": negate,
        "env": env,
        "secret": secret,
    }
    return field(default=default, metadata=meta)


def flag_of(f: Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")
