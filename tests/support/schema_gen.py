"""Random JSON schemas for the structured-output fuzz (`tests.support.schema_fuzz`).

`random_schema(rng)` draws from what clients send: every type, nested objects and arrays,
required, enum, const, anyOf/oneOf/allOf, $ref/$defs, patterns, formats, length, item and
numeric bounds, additionalProperties, and hostile schemas (deep nesting, huge enums,
contradictory bounds, keywords no grammar enforces, invalid values). Seeded, so a case number
reproduces.
"""

from __future__ import annotations

import json
import random
from typing import Any

# Patterns, split at spaces: anchored and not, classes, quantifiers, lookaround,
# backreferences, flags, Unicode, and invalid ones.
PATTERNS = r"""
^[a-z]+$ [0-9]{3} ^\d{2,4}-\d+$ a|b|c ^(ab)*$ ^\w+@\w+\.com$ x ^[A-Z][a-z]{0,5}$ (?=a)ab
(?!x)y ^(a)\1$ ^[^"]{1,3}$ ^.{2}$ \bword\b (?i)abc ^\p{L}+$ [ a{2,1} ^$ ^é+ü?$ ^[\s\S]{0,4}$
^(?:x|yz)?$ ^a+?b$ [\u0041-\u005a]+ ^\.\*$ a* ^\d*\.?\d+$ ^-?\d+(\.\d+)?$
^(\+\d{1,3})?\d{4,10}$ ^a(xy+)?b$ ^([a-z]+-)*[a-z]+$ ^(https?://)?[a-z.]+$
^[A-Z]{2}(-[0-9]+)??$ ^(a|b)*c{200}$
""".split()
ATOMS = ["a", "b", "x", "\\d", "\\w", "[a-c]", "[^a]", ".", "\\.", "-", "\\s", "[)?]", "é"]
QUANTIFIERS = ["", "", "", "?", "*", "+", "{2}", "{1,3}", "{0,2}", "{2,}", "??", "+?", "*?"]


def random_regex(rng: random.Random, depth: int = 2) -> str:
    """A regex of atoms, groups, alternations and quantifiers, anchored or not."""

    def piece(d: int) -> str:
        if d > 0 and rng.random() < 0.35:
            inner = "|".join(seq(d - 1) for _ in range(rng.randint(1, 2)))
            atom = rng.choice(["(", "(?:"]) + inner + ")"
        else:
            atom = rng.choice(ATOMS)
        return atom + rng.choice(QUANTIFIERS)

    def seq(d: int) -> str:
        return "".join(piece(d) for _ in range(rng.randint(1, 3)))

    return rng.choice(["^", ""]) + seq(depth) + rng.choice(["$", ""])


FORMATS = (
    "date time date-time duration email ipv4 ipv6 hostname uuid uri uri-reference uri-template "
    "json-pointer relative-json-pointer int32 binary regex idn-email idn-hostname iri float"
).split()
NAMES = ["a", "b", "name", "id", "x y", "", 'q"uote', "back\\slash", "ünï", "\t", "$ref", "0"]
NUMBERS = [0, 1, -1, 5, 10, 100, 0.5, -2.5, 1.25, 0.1234567, 1e-7, 3.999999, 1e15, 2**53, -1e30]
# Invalid schemas, and valid ones that no grammar can take as written.
INVALID = json.loads(
    """[{"type": "objectx"}, {"type": 5}, {"type": []}, {"minLength": -1, "type": "string"},
    {"minLength": "3"}, {"minLength": 1.5}, {"required": "a", "type": "object"},
    {"properties": [], "type": "object"}, {"enum": "a"}, {"enum": []}, {"items": 3},
    {"pattern": 5}, {"anyOf": []}, {"oneOf": {}}, {"allOf": [5]}, {"$ref": "#/nowhere"},
    {"$ref": "http://example.com/s.json"}, {"$ref": 3}, {"maximum": "9"}, {"format": 4},
    {"minimum": true}, {"exclusiveMinimum": true, "minimum": 1}, {"additionalProperties": 1},
    {"maxItems": -1, "type": "array"}, {"type": "integer", "minimum": 1.5, "maximum": 1.7},
    {"prefixItems": {}}, {"items": [{"type": "string"}]}, {"const": Infinity},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer"},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "integer"},
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}, "minLength": 3},
    {"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5},
    {"type": "string", "enum": ["a", 1]}, {"type": "integer", "enum": [1.5, 2]},
    {"type": "object", "required": ["x"]}, {"minimum": 5}, {"maxLength": 2},
    {"type": "string", "format": "date", "maxLength": 3},
    {"type": "string", "format": "email", "pattern": "^a"},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.000001},
    {"type": "number", "minimum": 0.1234567, "maximum": 0.1234568},
    {"oneOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]}, {"oneOf": [{"type": "integer"}, {}]},
    {"type": "string", "pattern": "^(a|b)*c{200}$"}, {"allOf": [{"type": "integer"}, {}]}]"""
)


class SchemaGen:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.defs: dict[str, Any] = {}

    def schema(self, depth: int) -> Any:
        rng = self.rng
        kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "types"]
        if depth > 0:
            kinds += ["object"] * 4 + ["array"] * 3 + ["anyOf", "oneOf", "allOf", "ref", "recur"]
        kinds += ["empty", "bool", "unenforced", "invalid"]
        kind = rng.choice(kinds)
        out = getattr(self, "_" + kind)(depth)
        if isinstance(out, dict) and rng.random() < 0.1:
            out.update(rng.choice([{"title": "T"}, {"description": "d"}, {"default": None}]))
        if isinstance(out, dict) and rng.random() < 0.05:  # untyped: keywords without a type
            out.pop("type", None)
        if isinstance(out, dict) and rng.random() < 0.03:  # a sibling of another form
            out.update(rng.choice([{"type": "string"}, {"minimum": 1}, {"required": ["a"]}]))
        return out

    def _string(self, depth: int) -> dict:
        s: dict[str, Any] = {"type": "string"}
        r = self.rng.random()
        if r < 0.15:
            s["pattern"] = self.rng.choice(PATTERNS)
        elif r < 0.3:
            s["pattern"] = random_regex(self.rng)
        elif r < 0.5:
            s["format"] = self.rng.choice(FORMATS)
        lengths = 0.4 if r >= 0.5 else 0.1  # beside a pattern or format: rarely
        if self.rng.random() < lengths:
            s["minLength"] = self.rng.choice([0, 1, 2, 5, 12])
        if self.rng.random() < lengths:
            s["maxLength"] = self.rng.choice([0, 1, 3, 8, 40])
        return s

    def _bounds(self, s: dict, integer: bool) -> dict:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if self.rng.random() < 0.3:
                s[key] = self.rng.choice(NUMBERS)
                if integer and self.rng.random() < 0.7:
                    s[key] = int(s[key]) if abs(s[key]) < 2**62 else 7
        return s

    def _integer(self, depth: int) -> dict:
        return self._bounds({"type": "integer"}, True)

    def _number(self, depth: int) -> dict:
        return self._bounds({"type": "number"}, False)

    def _boolean(self, depth: int) -> dict:
        return {"type": "boolean"}

    def _null(self, depth: int) -> dict:
        return {"type": "null"}

    def value(self, depth: int = 2) -> Any:
        rng = self.rng
        pick = rng.randrange(9 if depth > 0 else 6)
        if pick < 6:
            return [None, True, rng.choice(NUMBERS), rng.choice(NAMES), "\u0000\n\u2028", 0.0][pick]
        if pick < 8:
            return [self.value(depth - 1) for _ in range(rng.randrange(3))]
        return {rng.choice(NAMES): self.value(depth - 1) for _ in range(rng.randrange(3))}

    def _enum(self, depth: int) -> dict:
        if self.rng.random() < 0.05:  # hostile: a huge enum
            return {"enum": [f"v{i}" for i in range(self.rng.choice([500, 5000]))]}
        return {"enum": [self.value() for _ in range(self.rng.randint(1, 5))]}

    def _const(self, depth: int) -> dict:
        return {"const": self.value()}

    def _types(self, depth: int) -> dict:
        names = ["string", "integer", "number", "boolean", "null", "object", "array"]
        return {"type": self.rng.sample(names, self.rng.randint(1, 3))}

    def _object(self, depth: int) -> dict:
        rng = self.rng
        names = rng.sample(NAMES, rng.randint(0, 4))
        s: dict[str, Any] = {"type": "object"}
        if names or rng.random() < 0.5:
            s["properties"] = {n: self.schema(depth - 1) for n in names}
        if rng.random() < 0.6:
            pool = names + ["missing"] * (rng.random() < 0.15)
            s["required"] = rng.sample(pool, rng.randint(0, len(pool)))
        if rng.random() < 0.4:
            s["additionalProperties"] = rng.choice([True, False, self.schema(depth - 1)])
        return s

    def _array(self, depth: int) -> dict:
        rng = self.rng
        s: dict[str, Any] = {"type": "array"}
        if rng.random() < 0.8:
            s["items"] = self.schema(depth - 1)
        if rng.random() < 0.2:
            s["prefixItems"] = [self.schema(depth - 1) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.4:
            s["minItems"] = rng.choice([0, 1, 2, 4])
        if rng.random() < 0.4:
            s["maxItems"] = rng.choice([0, 1, 3, 6])
        return s

    def _combine(self, key: str, depth: int) -> dict:
        return {key: [self.schema(depth - 1) for _ in range(self.rng.randint(1, 3))]}

    def _anyOf(self, depth: int) -> dict:
        return self._combine("anyOf", depth)

    def _oneOf(self, depth: int) -> dict:
        return self._combine("oneOf", depth)

    def _allOf(self, depth: int) -> dict:
        return self._combine("allOf", depth)

    def _ref(self, depth: int) -> dict:
        name = f"d{len(self.defs)}"
        self.defs[name] = None  # reserved, so a recursive draw names another
        self.defs[name] = self.schema(depth - 1)
        return {"$ref": f"#/$defs/{name}"}

    def _recur(self, depth: int) -> dict:
        """A recursive list; its `next` is sometimes required, which no finite value meets."""
        name = f"d{len(self.defs)}"
        required = ["next"] if self.rng.random() < 0.3 else []
        link = {"anyOf": [{"$ref": f"#/$defs/{name}"}, {"type": "null"}]}
        node = {"$ref": f"#/$defs/{name}"} if required and self.rng.random() < 0.5 else link
        props = {"v": self.schema(0), "next": node}
        self.defs[name] = {"type": "object", "properties": props, "required": required}
        return {"$ref": f"#/$defs/{name}"}

    def _empty(self, depth: int) -> Any:
        return {}

    def _bool(self, depth: int) -> bool:
        return self.rng.random() < 0.7

    def _unenforced(self, depth: int) -> dict:
        """A schema with one keyword that constrains values but that a grammar may not
        enforce (or enforce only in part)."""
        base = self.schema(max(depth - 1, 0))
        base = base if isinstance(base, dict) else {}
        sub = self.schema(max(depth - 1, 0))
        keywords = {
            "not": sub,
            "multipleOf": self.rng.choice([2, 3, 0.5, 0]),
            "uniqueItems": True,
            "contains": sub,
            "minContains": 1,
            "if": sub,
            "then": sub,
            "else": sub,
            "dependentRequired": {"a": ["b"]},
            "dependentSchemas": {"a": sub},
            "dependencies": {"a": ["b"]},
            "propertyNames": {"maxLength": 1},
            "patternProperties": {"^x": sub},
            "unevaluatedProperties": False,
            "unevaluatedItems": False,
            "additionalItems": False,
            "minProperties": 1,
            "maxProperties": 1,
            "$dynamicRef": "#meta",
        }
        key = self.rng.choice(sorted(keywords))
        return {**base, key: keywords[key]}

    def _invalid(self, depth: int) -> dict:
        return dict(self.rng.choice(INVALID))


def deep(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def random_schema(rng: random.Random) -> Any:
    """One schema; about 1 in 40 is a hostile extreme (deep, wide or bounded far out)."""
    if rng.random() < 0.025:
        return rng.choice(
            [
                deep(rng.choice([20, 63, 70, 500])),
                {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "integer"} for i in range(3000)},
                },
                {"type": "string", "minLength": 10**6},
                {"type": "array", "items": {"type": "integer"}, "minItems": 10**5},
                {"type": "integer", "minimum": -(2**70), "maximum": 2**70},
                {"type": "string", "pattern": "^(a|b)*c{1000}$"},
                {"anyOf": [{"const": i} for i in range(2000)]},
            ]
        )
    gen = SchemaGen(rng)
    schema = gen.schema(rng.choice([1, 2, 3, 4]))
    if gen.defs and isinstance(schema, dict):
        schema = {**schema, "$defs": gen.defs}
    return schema
