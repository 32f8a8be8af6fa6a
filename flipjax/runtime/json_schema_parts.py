"""The vocabulary `flipjax.runtime.json_schema` checks schemas against: which keywords xgrammar
enforces, which it would pass over, the formats it enforces and the exact patterns that replace
its loose ones, and the checks of single keyword values (patterns, enum and const values,
`$schema`)."""

from __future__ import annotations

import json
import math
import re
from decimal import ROUND_CEILING, Decimal
from typing import Any

TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
# Assertions xgrammar does not enforce (or enforces only in some combinations).
UNSUPPORTED = frozenset(
    "not if then else multipleOf uniqueItems contains minContains maxContains dependentRequired "
    "dependentSchemas dependencies propertyNames patternProperties unevaluatedProperties "
    "unevaluatedItems additionalItems $dynamicRef $recursiveRef".split()
)
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
LOWER = ("minimum", "exclusiveMinimum")
UPPER = ("maximum", "exclusiveMaximum")
BOUNDS = LOWER + UPPER
# The keywords that constrain one type's values, which xgrammar applies together.
TYPED = frozenset(
    "type properties required additionalProperties items prefixItems pattern format".split()
    + [*COUNTS, *BOUNDS]
)
FORMS = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const"})
# Keywords xgrammar applies only where the schema names a type (untyped, it passes them over).
NEEDS_TYPE = (
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    *BOUNDS,
)
ENFORCED_FORMATS = frozenset(
    "date time date-time duration email ipv4 ipv6 hostname uuid uri uri-reference uri-template "
    "json-pointer relative-json-pointer".split()
)

# RFC 3339 full-date, every day of every month (years 0001-9999, as Python's datetime has
# them), partial-time with offset, and RFC 2673's dotted quad (no leading zeros).
_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
_DAY = (
    r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
    r"|02-(0[1-9]|1\d|2[0-8]))"
)
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)-02-29"
_DATE = rf"({_YEAR}-{_DAY}|{_LEAP})"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d{1,9}){0,1}(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
}
# xgrammar's number ranges have this precision: a range without such a number compiles empty.
NUMBER_STEP = Decimal("0.000001")
_SCHEMA_VERSIONS = re.compile(r"json-schema\.org/(draft-0[67]|draft/2019-09|draft/2020-12)/")


def enforced_format(s: dict[str, Any]) -> bool:
    return s.get("format") in ENFORCED_FORMATS


def check_values(s: dict[str, Any], path: str) -> None:
    """enum and const values are JSON: no NaN or infinity."""
    for key in ("enum", "const"):
        if key in s and not _is_json(s[key]):
            raise ValueError(f"{path}/{key}: holds a number that is not finite")


def _is_json(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_is_json(x) for x in v)
    if isinstance(v, dict):
        return all(_is_json(x) for x in v.values())
    return True


def schema_version(uri: Any, path: str) -> None:
    if not isinstance(uri, str) or not _SCHEMA_VERSIONS.search(uri):
        raise ValueError(f"{path}/$schema: only drafts 6, 7, 2019-09 and 2020-12 are supported")


def types_of_value(v: Any) -> set[str]:
    """The JSON types of an instance value (a whole number is an integer and a number)."""
    if isinstance(v, bool):
        return {"boolean"}
    if v is None:
        return {"null"}
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"}
    return {"string"} if isinstance(v, str) else {"array"} if isinstance(v, list) else {"object"}


def has_number(s: dict[str, Any]) -> bool:
    """Some number of at most six decimals lies within the bounds of `s`."""
    low = [(Decimal(repr(s[k])), k == "exclusiveMinimum") for k in LOWER if k in s]
    high = [(Decimal(repr(s[k])), k == "exclusiveMaximum") for k in UPPER if k in s]
    if not low or not high:
        return True
    lo, lo_open = max(low, key=lambda b: (b[0], b[1]))
    hi, hi_open = min(high, key=lambda b: (b[0], not b[1]))
    first = (lo / NUMBER_STEP).to_integral_value(ROUND_CEILING) * NUMBER_STEP
    first += NUMBER_STEP if lo_open and first == lo else 0
    return first < hi if hi_open else first <= hi


def enum_values(s: dict[str, Any]) -> set[str] | None:
    """The values an enum or const schema allows, compared as JSON Schema compares them."""
    if "enum" not in s and "const" not in s:
        return None
    values = s.get("enum", []) + ([s["const"]] if "const" in s else [])
    return {json.dumps(canonical(v), sort_keys=True) for v in values}


def canonical(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [canonical(x) for x in v]
    if isinstance(v, dict):
        return {k: canonical(x) for k, x in v.items()}
    return v
