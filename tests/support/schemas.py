"""JSON schemas more than one test module compiles."""

from __future__ import annotations


def nested_array_schema(depth: int) -> dict:
    """An array of arrays, `depth` objects deep: the shape whose compile time grows fastest."""
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema
