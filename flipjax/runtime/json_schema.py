"""A client's JSON schema, checked and made ready before xgrammar compiles it.

xgrammar compiles a schema into a grammar but passes over, with no more than a log line, what
it cannot express: keywords such as `not`, `multipleOf` or `uniqueItems`; keywords beside
`$ref`, `anyOf`, `oneOf`, `allOf`, `enum` or `const`; lengths beside a `pattern` or a
`format`; bounds on a value without a `type`; `required` names that `properties` lacks;
`oneOf` branches that can both match. A number range that holds no number of six decimals
compiles to an empty value, and its `date`, `date-time` and `ipv4` formats admit days past
the month's end and leading zeros. Structured output must match its schema or be refused, so
each of these is a ValueError naming the schema path (`#/properties/a`) and the reason, as is
a schema that no finite value meets (a required `$ref` cycle) or one that is not a valid
schema. Annotations (titles, descriptions, unknown keywords, formats xgrammar does not know)
pass. Two rewrites keep the meaning: the three loose formats become their RFCs' patterns, and
patterns are written the way xgrammar's regex compiler gets them right (`json_pattern`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

from flipjax.runtime.json_pattern import xgrammar_pattern
from flipjax.runtime.json_schema_parts import (
    BOUNDS,
    COUNTS,
    FORMAT_PATTERNS,
    FORMS,
    NEEDS_TYPE,
    TYPED,
    TYPES,
    UNSUPPORTED,
    check_values,
    enforced_format,
    enum_values,
    has_number,
    schema_version,
    types_of_value,
)

MAX_ONE_OF = 256  # oneOf branches compared pairwise for overlap
# Exclusive number bounds from here on are refused: doubles this large are 2**-19 (about 2e-6)
# apart, wider than xgrammar's step, so the nearest number past the bound parses as the bound.
MAX_EXCLUSIVE = 2.0**33


def prepare_schema(spec: Any) -> Any:
    """The schema to compile for `spec` (a JSON schema, or its text); ValueError naming the
    schema path and the reason where it would not be enforced as written."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as err:
            raise ValueError(f"the schema is not valid JSON: {err}") from None
    if not isinstance(spec, dict):
        raise ValueError("#: the schema must be a JSON object")
    checker = _Schema(spec)
    prepared = checker.node(spec, "#")
    finite = checker.finite_refs()
    if not checker.finite(spec, finite):
        raise ValueError("#: the schema admits no finite value (a required $ref cycle or false)")
    endless = sorted(checker.refs - finite)  # a value could start there and never end
    if endless:
        raise ValueError(f"{endless[0]}: admits no finite value (a required $ref cycle)")
    return prepared


def _refuse(path: str, reason: str) -> None:
    raise ValueError(f"{path}: {reason}")


class _Schema:
    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.refs: set[str] = set()

    def node(self, s: Any, path: str) -> Any:
        """`s` checked, with its subschemas, and made ready; ValueError where not enforced."""
        if isinstance(s, bool):
            return s
        if not isinstance(s, dict):
            _refuse(path, f"a schema must be an object or a boolean, not {json.dumps(s)[:40]}")
        for key in s:
            if key in UNSUPPORTED:
                _refuse(f"{path}/{key}", "is not supported: the grammar cannot enforce it")
        if "$schema" in s:
            schema_version(s["$schema"], path)
        if "$id" in s and path != "#":
            _refuse(f"{path}/$id", "is not supported below the root")
        out = dict(s)
        for key in ("items", "additionalProperties"):
            if key in s:
                if isinstance(s[key], list):
                    _refuse(f"{path}/{key}", "must be one schema (prefixItems lists them)")
                out[key] = self.node(s[key], f"{path}/{key}")
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if key in s:
                if not isinstance(s[key], list) or not s[key]:
                    _refuse(f"{path}/{key}", "must be a non-empty list of schemas")
                out[key] = [self.node(b, f"{path}/{key}/{i}") for i, b in enumerate(s[key])]
        for key in ("properties", "$defs", "definitions"):
            if key in s:
                if not isinstance(s[key], dict):
                    _refuse(f"{path}/{key}", "must be an object of schemas")
                out[key] = {k: self.node(v, f"{path}/{key}/{k}") for k, v in s[key].items()}
        self.keywords(out, path)
        self.forms(out, path)
        if out.get("format") in FORMAT_PATTERNS:
            out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
        if "pattern" in out:
            out["pattern"] = xgrammar_pattern(out["pattern"], f"{path}/pattern")
        return out

    def keywords(self, s: dict[str, Any], path: str) -> None:
        """The values of the assertion keywords are what JSON Schema allows."""
        if "type" in s:
            t = s["type"]
            names = t if isinstance(t, list) else [t]
            if not names or any(n not in TYPES for n in names) or len(set(names)) < len(names):
                _refuse(f"{path}/type", f"must be one of {sorted(TYPES)} or a list of them")
        for key in COUNTS:
            v = s.get(key)
            if key in s and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                _refuse(f"{path}/{key}", "must be a non-negative integer")
        for key in BOUNDS:
            v = s.get(key)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if key in s and not ok:
                _refuse(f"{path}/{key}", "must be a finite number")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            _refuse(f"{path}/required", "must be a list of property names")
        if len(set(required)) < len(required):
            _refuse(f"{path}/required", "names a property twice")
        if "enum" in s and (not isinstance(s["enum"], list) or not s["enum"]):
            _refuse(f"{path}/enum", "must be a non-empty list")
        check_values(s, path)
        if "format" in s and not isinstance(s["format"], str):
            _refuse(f"{path}/format", "must be a string")
        if "$ref" in s:
            self.resolve(s["$ref"], f"{path}/$ref")

    def forms(self, s: dict[str, Any], path: str) -> None:
        """Keywords xgrammar applies together, and the ones it would pass over."""
        asserting = {k for k in s if k in TYPED or k in FORMS}
        if "format" in s and not enforced_format(s):
            asserting.discard("format")
        for form in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const"):
            others = sorted(asserting - {form, *(("type",) if form in ("enum", "const") else ())})
            if form in s and others:
                _refuse(f"{path}", f"{form} beside {', '.join(others)} is not supported")
        if len(s.get("allOf", [])) > 1:
            _refuse(f"{path}/allOf", "more than one schema is not supported")
        for form in ("enum", "const"):
            values = s.get("enum", []) if form == "enum" else [s.get("const")]
            if form in s and "type" in s and any(not types_of_value(v) & _types(s) for v in values):
                _refuse(f"{path}/{form}", f"holds a value that is not of type {s['type']}")
        lengths = sorted({"minLength", "maxLength"} & set(s))
        if "pattern" in s and lengths:
            _refuse(path, f"pattern beside {', '.join(lengths)} is not supported")
        if enforced_format(s) and (lengths or "pattern" in s):
            others = ", ".join(lengths + ["pattern"] * ("pattern" in s))
            _refuse(path, f"format {s['format']} beside {others} is not supported")
        untyped = sorted(k for k in NEEDS_TYPE if k in s and k in asserting)
        if "type" not in s and untyped:
            _refuse(path, f"{', '.join(untyped)} needs a type (untyped, it is not applied)")
        if "number" in _types(s):
            self.number_bounds(s, path)
        names = s.get("properties", {})
        for name in s.get("required", []):
            if name not in names:
                _refuse(f"{path}/required", f"{name!r} is not in properties")
        if "oneOf" in s:
            self.disjoint_branches(s["oneOf"], f"{path}/oneOf")

    def number_bounds(self, s: dict[str, Any], path: str) -> None:
        if not has_number(s):
            _refuse(path, "the bounds hold no number of at most six decimals")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if abs(s.get(key, 0)) >= MAX_EXCLUSIVE:
                # A number just past it reads back as the bound itself, which it excludes.
                _refuse(f"{path}/{key}", f"past {MAX_EXCLUSIVE:.0e} is not supported as exclusive")

    def resolve(self, ref: Any, path: str) -> Any:
        """The schema `ref` points to in this document."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            _refuse(path, "only references into this schema (#/...) are supported")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                _refuse(path, f"{ref} does not resolve")
        self.refs.add(ref)
        return target

    def deref(self, s: Any) -> Any:
        for _ in range(16):
            if not isinstance(s, dict) or "$ref" not in s:
                return s
            s = self.resolve(s["$ref"], "#")
        return True  # a long chain: anything, as far as this check can tell

    def types(self, s: Any, depth: int = 8) -> set[str]:
        """The JSON types `s` may match (integer stands for whole numbers)."""
        s = self.deref(s)
        if depth == 0 or s is True or not isinstance(s, dict):
            return set() if s is False else set(TYPES)
        if "enum" in s or "const" in s:
            values = s.get("enum", []) + ([s["const"]] if "const" in s else [])
            return set().union(*(types_of_value(v) for v in values))
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s:
                return set().union(*(self.types(b, depth - 1) for b in s[key]))
        names = _types(s) if "type" in s else set(TYPES)
        return names | {"integer"} if "number" in names else names

    def disjoint(self, a: Any, b: Any, depth: int = 4) -> bool:
        """No value matches both `a` and `b` (False where this cannot tell)."""
        a, b = self.deref(a), self.deref(b)
        if a is False or b is False:
            return True
        if not self.types(a) & self.types(b):
            return True
        if not isinstance(a, dict) or not isinstance(b, dict) or depth == 0:
            return False
        va, vb = enum_values(a), enum_values(b)
        if va is not None and vb is not None:
            return not va & vb
        pa, pb = a.get("properties", {}), b.get("properties", {})
        shared = set(a.get("required", [])) & set(b.get("required", []))
        objects = self.types(a) & self.types(b) == {"object"}
        return objects and any(self.disjoint(pa[n], pb[n], depth - 1) for n in shared)

    def disjoint_branches(self, branches: list[Any], path: str) -> None:
        if len(branches) > MAX_ONE_OF:
            _refuse(path, f"more than {MAX_ONE_OF} branches is not supported (anyOf is)")
        for i, a in enumerate(branches):
            for j in range(i + 1, len(branches)):
                if not self.disjoint(a, branches[j]):
                    _refuse(path, f"branches {i} and {j} may both match (anyOf allows that)")

    def finite_refs(self) -> set[str]:
        """The references some finite value matches: the least fixpoint, each evaluated
        again only when one it reads is found finite."""
        known: set[str] = set()
        readers: dict[str, set[str]] = defaultdict(set)
        work = sorted(self.refs)
        while work:
            ref = work.pop()
            reads: set[str] = set()
            if ref not in known and self._finite(self.resolve(ref, "#"), known, reads):
                known.add(ref)
                work.extend(readers[ref])
            for r in reads:
                readers[r].add(ref)
        return known

    def finite(self, s: Any, known: set[str]) -> bool:
        return self._finite(s, known, set())

    def _finite(self, s: Any, known: set[str], reads: set[str]) -> bool:
        if not isinstance(s, dict):
            return s is not False
        if "$ref" in s:
            reads.add(s["$ref"])
            return s["$ref"] in known
        if "enum" in s or "const" in s:
            return True
        if "anyOf" in s or "oneOf" in s:
            return any(self._finite(b, known, reads) for b in s.get("anyOf", s.get("oneOf")))
        if "allOf" in s:
            return all(self._finite(b, known, reads) for b in s["allOf"])
        types = _types(s) if "type" in s else set(TYPES)
        if types - {"object", "array"}:
            return True
        if "object" in types:
            props = s.get("properties", {})
            return all(
                self._finite(props.get(r, True), known, reads) for r in s.get("required", [])
            )
        prefix, rest = s.get("prefixItems", []), s.get("items", True)
        needed = prefix[: s.get("minItems", 0)] + [rest] * (s.get("minItems", 0) > len(prefix))
        return all(self._finite(item, known, reads) for item in needed)


def _types(s: dict[str, Any]) -> set[str]:
    """The names in `s`'s type keyword (none without one)."""
    t = s.get("type", [])
    return set(t if isinstance(t, list) else [t])
