r"""What the schema fuzz holds structured output to: strict JSON (UTF-8, no duplicate keys, no
NaN), valid against the schema by `jsonschema`, with the string formats the grammar enforces
checked too (the others are annotations, as JSON Schema 2020-12 has them by default), and
patterns read as ECMA-262 reads them, as JSON Schema says: Python's `\s` lacks U+FEFF."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid
from typing import Any

import jsonschema

# How the fuzz buckets refusals: by words of their messages past the field and schema path.
REASONS = (
    ("too deep or too large", "levels deep|bytes; at most"),
    ("compile timeout", "did not compile within"),
    ("unsupported keyword", "the grammar cannot enforce"),
    ("unsupported combination", " beside |more than one|may both match|needs a type|properties"),
    ("unsupported pattern", "JSON escapes|repetition|lookaround|escape|yet"),
    ("unsupported $ref, $id, $schema or bound", "$ref|$id|drafts|only references|as exclusive"),
    ("unsatisfiable", "admits no|hold no number|cannot accept any|greater than|less than|whole"),
    ("invalid schema", "must be|not a valid|resolve|twice|not finite|not of type|Unsupported"),
    ("invalid schema", "Invalid|exceeds|contains false"),
)

_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DURATION = r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?"
_POINTER = r"(/([^~/]|~[01])*)*"


def _time_ok(m: re.Match, at: int) -> bool:
    hour, minute, second = (int(m.group(at + i)) for i in range(3))
    zone = [int(m.group(at + i) or 0) for i in (5, 6)]
    return hour < 24 and minute < 60 and second <= 60 and zone[0] < 24 and zone[1] < 60


def _date_ok(m: re.Match) -> bool:
    try:
        datetime.date(*(int(m.group(i)) for i in (1, 2, 3)))
    except ValueError:
        return False
    return True


def _is_date_time(s: str) -> bool:
    m = re.fullmatch(f"{_DATE}[Tt]{_TIME}", s, re.ASCII)
    return bool(m) and _date_ok(m) and _time_ok(m, 4)


def _is_time(s: str) -> bool:
    m = re.fullmatch(_TIME, s, re.ASCII)
    return bool(m) and _time_ok(m, 1)


def _is_date(s: str) -> bool:
    m = re.fullmatch(_DATE, s, re.ASCII)
    return bool(m) and _date_ok(m)


def _is_ip(kind: type) -> Any:
    def check(s: str) -> bool:
        try:
            kind(s)
        except ValueError:
            return False
        return True

    return check


def _is_uuid(s: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", s)) and bool(
        uuid.UUID(s)
    )


FORMATS = {
    "date": _is_date,
    "time": _is_time,
    "date-time": _is_date_time,
    "duration": lambda s: bool(re.fullmatch(_DURATION, s, re.ASCII)),
    "email": lambda s: "@" in s,
    "ipv4": _is_ip(ipaddress.IPv4Address),
    "ipv6": _is_ip(ipaddress.IPv6Address),
    "hostname": lambda s: (
        bool(re.fullmatch(rf"{_LABEL}(\.{_LABEL})*", s, re.ASCII)) and len(s) <= 253
    ),
    "uuid": _is_uuid,
    "json-pointer": lambda s: bool(re.fullmatch(_POINTER, s)),
    "relative-json-pointer": lambda s: bool(re.fullmatch(rf"(0|[1-9]\d*)(#|{_POINTER})", s)),
}
CHECKER = jsonschema.FormatChecker(formats=())
for _name, _check in FORMATS.items():
    CHECKER.checks(_name)(lambda v, check=_check: not isinstance(v, str) or check(v))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in an object: {keys}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_strict(text: str) -> Any:
    """The JSON value of `text` (RFC 8259: no NaN, no duplicate keys); ValueError if none."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


def validation_error(raw: bytes, schema: Any) -> str:
    """Why `raw` is not a valid instance of `schema` ("" when it is)."""
    try:
        value = parse_strict(raw.decode("utf-8"))
    except ValueError as err:
        return f"not JSON: {err}"
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        ecma = jsonschema.validators.extend(cls, {"pattern": _ecma_pattern})
        error = jsonschema.exceptions.best_match(
            ecma(schema, format_checker=CHECKER).iter_errors(value)
        )
    except jsonschema.SchemaError as err:
        return f"accepted an invalid schema: {err.message}"
    except jsonschema.exceptions.RefResolutionError as err:
        return f"accepted a schema with a dangling $ref: {err}"
    except Exception as err:  # noqa: BLE001 - a schema jsonschema cannot even walk
        return f"accepted a schema jsonschema cannot use: {type(err).__name__}: {err}"
    if error is None:
        return ""
    where = "/".join(str(p) for p in error.absolute_path)
    return f"schema rejects the output at /{where}: {error.message[:200]}"


def _ecma_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not re.search(ecma_regex(pattern), instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def ecma_regex(pattern: str) -> str:
    r"""`pattern` for Python's `re`, with `\s` as wide as ECMA-262's (which adds U+FEFF)."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        step = 2 if pattern[i] == "\\" else 1
        ch = pattern[i : i + step]
        if ch == r"\s":
            ch = "\\s\ufeff" if in_class else "[\\s\ufeff]"
        elif ch in "[]":
            in_class = ch == "["
        out.append(ch)
        i += step
    return "".join(out)


def demands_long_output(schema: Any, size: int) -> bool:
    """`schema` asks somewhere for at least `size` characters, items or properties."""
    if isinstance(schema, list):
        return any(demands_long_output(s, size) for s in schema)
    if not isinstance(schema, dict):
        return False
    counts = [schema.get(k) for k in ("minLength", "minItems", "minProperties")]
    if any(isinstance(c, int) and c >= size for c in counts):
        return True
    return any(demands_long_output(v, size) for v in schema.values())
