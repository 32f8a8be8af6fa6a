"""What each op of a compiled step program is, read from its optimized HLO text: the kind of work
(`Op.kind`) and, for a matrix product, its FLOPs. `step_profile` names the ops of a traced step
by it; XLA:CPU's trace events carry an op's HLO name and nothing more.

Kinds: a flipjax kernel by its custom-call target (the build's ISA suffix aside), another
custom call by its target, an XLA dot (alone or inside a fusion) as "matmuls", everything else
as "XLA's other ops". Only instructions that run as ops are named: parameters, constants,
bitcasts and tuples have no op of their own in a program run (`ops` leaves them out, so that a
traced run of the program has exactly these ops).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MATMULS = "matmuls"
OTHER_XLA = "XLA's other ops"

# Instructions XLA:CPU runs no op for (it resolves them to buffers when it compiles).
NO_OP = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all"})
# flipjax's kernels (`flipjax_*` targets, `kernels_pallas`) by the part of the target naming them.
NATIVE_KINDS = (
    ("ragged_matmul", MATMULS),
    ("matmul", MATMULS),
    ("gdn_decode", "GDN recurrence"),
    ("conv_pool", "GDN conv"),
    ("gated_norm", "gated norm"),
    ("paged_decode", "decode attention"),
    ("write_rows", "KV page writes"),
    ("silu_mul", "gates"),
    ("sigmoid_mul", "gates"),
)

_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_SHAPE = re.compile(r"^[a-z0-9]+\[([\d,]*)\]")
_OPERAND_SHAPES = re.compile(r"operand_layout_constraints=\{(.*?)\}\s*,\s*\w+=")
_DIMS = re.compile(r"[a-z0-9]+\[([\d,]*)\]")


@dataclass(frozen=True)
class Op:
    kind: str
    flops: float  # of a matrix product; 0 for every other op


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _instruction(line: str) -> tuple[str, str, str, str] | None:
    """(name, shape, opcode, the rest after the opcode's parenthesis) of an HLO instruction
    line; a tuple's shape, in parentheses with spaces, whole."""
    m = _DEFINITION.match(line)
    if not m:
        return None
    name, text = m.groups()
    if text.startswith("("):  # a tuple's shape has spaces: it ends at its closing parenthesis
        depth, end = 0, len(text)
        for i, c in enumerate(text):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                end = i + 1
                break
        shape, text = text[:end], text[end:].lstrip()
    else:
        shape, _, text = text.partition(" ")
    opcode, paren, rest = text.partition("(")
    return (name, shape, opcode, rest) if paren else None


def _computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name ("ENTRY" for the entry computation)."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if header:
            current = bodies.setdefault("ENTRY" if header.group(1) else header.group(2), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return bodies


def _dot_flops(lines: list[str]) -> float:
    """The FLOPs of the dots among `lines` (one computation's): 2 x the output's elements x the
    contracted size of the left operand."""
    shapes: dict[str, tuple[int, ...]] = {}
    flops = 0.0
    for line in lines:
        if (parsed := _instruction(line)) is None:
            continue
        name, shape, opcode, rest = parsed
        dims = _SHAPE.match(shape)
        shapes[name] = _dims(dims.group(1)) if dims else ()
        if opcode != "dot":
            continue
        lhs = re.match(r"\s*%([\w.\-]+)", rest)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        if lhs is None or contracting is None or lhs.group(1) not in shapes:
            continue
        left, axes = shapes[lhs.group(1)], _dims(contracting.group(1))
        if any(a >= len(left) for a in axes):  # a shape the pattern cannot read (dynamic)
            continue
        k = math.prod(left[a] for a in axes)
        flops += 2.0 * math.prod(shapes[name]) * k
    return flops


def _native_matmul_flops(rest: str) -> float:
    """A native matmul's FLOPs from its operands' shapes: x [M, K], then weights [K, N_i] (or a
    grouped matmul's [G, K, N], each of x's rows multiplied by one group)."""
    found = _OPERAND_SHAPES.search(rest)
    if not found:
        return 0.0
    operands = [_dims(d) for d in _DIMS.findall(found.group(1))]
    if not operands or len(operands[0]) != 2:
        return 0.0
    m, k = operands[0]
    return sum(2.0 * m * k * w[-1] for w in operands[1:] if len(w) in (2, 3) and w[-2] == k)


def module_name(hlo: str) -> str:
    """The module's name, as XLA's trace events give it (`hlo_module`)."""
    m = re.match(r"\s*HloModule ([^\s,]+)", hlo)
    if not m:
        raise ValueError("step HLO: the program's text does not start with its module's name")
    return m.group(1)


def ops(hlo: str) -> dict[str, Op]:
    """Each op of the entry computation of `hlo` (a compiled program's `as_text()`) by name:
    what kind of work it does, and its FLOPs where it is a matrix product."""
    bodies = _computations(hlo)
    if "ENTRY" not in bodies:
        raise ValueError("step HLO: no entry computation in the program's text")
    found: dict[str, Op] = {}
    entry = bodies["ENTRY"]
    for line in entry:
        if (parsed := _instruction(line)) is None:
            continue
        name, _, opcode, rest = parsed
        if opcode in NO_OP:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        if opcode == "custom-call" and target:
            called = target.group(1)
            kind = next((k for part, k in NATIVE_KINDS if part in called), None)
            if not called.startswith("flipjax_") or kind is None:
                kind = f"custom call ({called})"  # XLA's own (TopK), or a kernel not listed
            flops = _native_matmul_flops(rest) if kind == MATMULS else 0.0
            found[name] = Op(kind, flops)
            continue
        if opcode == "dot":  # after the lines that give its operands' shapes, which it names only
            flops = _dot_flops([*_defining(entry, rest), line])
        else:  # YNNPACK's dots, among others, run as fusions that call them
            called = re.search(r"calls=%([\w.\-]+)", rest)
            flops = _dot_flops(bodies.get(called.group(1), [])) if called else 0.0
        found[name] = Op(MATMULS, flops) if flops else Op(OTHER_XLA, 0.0)
    return found


def _defining(entry: list[str], rest: str) -> list[str]:
    """The lines of `entry` that define the operands named in `rest` (a dot's)."""
    names = set(re.findall(r"%([\w.\-]+)", rest.split(")")[0]))
    return [line for line in entry if (p := _instruction(line)) and p[0] in names]
