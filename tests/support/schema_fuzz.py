"""Structured-output schema fuzz: every JSON schema a client sends is refused with a 400 naming
its field and the reason, or constrains the output to valid JSON that the schema accepts.

Each case draws a schema (`tests.support.schema_gen`) and a form to send it in
(`response_format` json_schema, `guided_json` as an object or as text, `structured_outputs`,
a named or a `required` tool choice). The body is parsed by the server's own pydantic model and
compiled by the request path's own function (`serve.structured.grammar_for`, after the tool
plan), which runs the server's checks of the spec; then walks take random allowed tokens of
the tiny model's tokenizer until the grammar completes, and each text must parse as strict JSON
and validate with `jsonschema` (`tests.support.schema_check`). A failure is any other end: an
error that is not a 400 naming its field, a dead end (no token allowed), no end within the
token budget (unless the schema asks for more: "cut"), text the schema rejects, or a schema
refused for `tool_choice: "required"` but taken for a named tool. Each failure is shrunk to a
minimal reproducer. No model runs; `--http N` also sends N bodies to a real server in this
process (`tests.support.schema_http`).

    python -m tests.support.schema_fuzz --cases 4000 [--seed 0] [--http 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from pydantic import ValidationError

from flipjax.config.tree import ServeConfig
from flipjax.model.tiny import tiny_config
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.grammar import GrammarCompiler
from serve.errors import APIError
from serve.protocol.chat import ChatRequest
from serve.structured import grammar_for
from serve.tools import plan
from tests.support.schema_check import REASONS, demands_long_output, validation_error
from tests.support.schema_gen import random_schema
from tests.support.schema_http import FORMS, http_fuzz, request_body


@dataclass
class Outcome:
    kind: str  # "refused", "valid", "cut" (longer than the budget, as asked) or "failure"
    reason: str  # why refused (a bucket of REASONS), or what failed
    detail: str = ""
    text: str = ""


class SchemaFuzz:
    """The checker: the server's request path up to the grammar, then a random walk."""

    def __init__(self, budget: int = 4096, walks: int = 3, timeout_s: float | None = None):
        self.tokenizer = ByteTokenizer()
        self.walks = walks
        self.vocab = tiny_config().vocab_size
        self.budget = budget
        grammars = GrammarCompiler(self.tokenizer, self.vocab)
        config = ServeConfig(**({} if timeout_s is None else {"grammar_timeout_s": timeout_s}))
        self.state = SimpleNamespace(grammars=grammars, grammar_lock=asyncio.Lock(), config=config)
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def check(self, form: str, schema: Any, seed: int = 0) -> Outcome:
        try:
            req = ChatRequest.model_validate(request_body(form, schema))
        except ValidationError as err:
            return Outcome("refused", "request body", str(err.errors()[0]["loc"]))
        try:
            tools = plan(req)
            make = self.loop.run_until_complete(grammar_for(self.state, req, tools.spec))
        except APIError as err:
            named = bool(err.param) and err.message.startswith(f"{err.param}:")
            if err.status != 400 or not named:
                return Outcome("failure", f"HTTP {err.status}", f"{err.param}: {err.message}")
            if form == "required" and self.check("named", schema).kind != "refused":
                return Outcome("failure", "refused as required, not as named", err.message)
            return Outcome("refused", _bucket(err.message), err.message)
        except Exception as err:  # noqa: BLE001 - what the server would answer with a 500
            return Outcome("failure", "HTTP 500", f"{type(err).__name__}: {err}")
        assert make is not None
        target = tools.spec[1] if tools.spec is not None else schema
        long = demands_long_output(target, self.budget // 4)
        for walk in range(self.walks):  # each walk a fresh constraint, as each request has
            raw, end = self.walk(make(), random.Random(seed * self.walks + walk), not long)
            text = raw.decode("utf-8", errors="backslashreplace")
            problem = validation_error(raw, target) if end == "done" else end
            if problem.startswith("no end") and long:
                return Outcome("cut", "the schema asks for more than the token budget", text=text)
            if problem:
                return Outcome("failure", problem, text=text)
        return Outcome("valid", "", text=text)

    def walk(self, constraint: Any, rng: random.Random, finish: bool = True) -> tuple[bytes, str]:
        """Random allowed tokens until the grammar completes: for `budget` tokens exploring
        (closing brackets and quotes likelier than the rest, whitespace rarer), then as many
        `finishing`, so that a grammar that can end does."""
        eos = self.tokenizer.eos_token_id
        out = bytearray()
        steps = (1 + finish) * self.budget
        for step in range(steps):
            allowed = self.allowed(constraint)
            if not allowed:
                return bytes(out), "dead end: no token allowed"
            if eos in allowed and (len(allowed) == 1 or rng.random() < 0.9):
                constraint.accept(eos)
                return bytes(out), "done" if constraint.done else "stop token did not end it"
            allowed = [t for t in allowed if t != eos]
            if allowed[-1] >= 256:
                return bytes(out), f"a special token is allowed: {allowed[-1]}"
            if step < self.budget:
                token = rng.choices(allowed, EXPLORE[allowed].tolist())[0]
            else:
                token = self.finishing(constraint, allowed, _in_string(out), rng)
            constraint.accept(token)
            out.append(token)
        return bytes(out), f"no end within {steps} tokens"

    def allowed(self, constraint: Any) -> list[int]:
        bits = np.unpackbits(constraint.next_mask().view(np.uint8), bitorder="little")
        return [int(t) for t in np.flatnonzero(bits[: self.vocab])]

    def finishing(self, constraint: Any, allowed: list[int], in_string: bool, rng: Any) -> int:
        """A token towards the end: a closing quote, bracket or brace where one is allowed,
        else in a string one after which its quote is (looking one token ahead), else any
        ASCII token."""
        for closer in b'"' if in_string else b"]}":
            if closer in allowed:
                return closer
        ascii_ = [t for t in allowed if t < 0x80] or allowed
        if in_string:
            ahead = [t for t in ascii_ if ord('"') in self.allowed(_after(constraint, t))]
            ascii_ = ahead or ascii_
        return rng.choice(ascii_)

    def run(self, cases: int, seed: int = 0, shrink_failures: bool = True) -> dict[str, Any]:
        counts: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        failures: list[dict[str, Any]] = []
        slowest = (0.0, -1)
        for case in range(cases):
            rng = random.Random(seed * 1_000_003 + case)
            schema, form = random_schema(rng), rng.choice(FORMS)
            t0 = time.perf_counter()
            got = self.check(form, schema, case)
            slowest = max(slowest, (time.perf_counter() - t0, case))
            counts[got.kind] += 1
            if got.kind == "refused":
                refused[got.reason] += 1
            elif got.kind == "failure":
                failures.append(self.report(case, form, schema, got, shrink_failures))
        return {
            "cases": cases,
            **counts,
            "refused_by": dict(refused),
            "failures": failures,
            "slowest_case": {"case": slowest[1], "seconds": round(slowest[0], 3)},
        }

    def report(self, case: int, form: str, schema: Any, got: Outcome, shrink_it: bool) -> dict:
        def same(candidate: Any) -> bool:
            again = self.check(form, candidate, case)
            return again.kind == "failure" and again.reason.split(":")[0] == reason

        reason = got.reason.split(":")[0]
        minimal = shrink(schema, same) if shrink_it else schema
        final = self.check(form, minimal, case)
        return {
            "case": case,
            "form": form,
            "reason": final.reason,
            "detail": final.detail[:300],
            "schema": _shown(minimal),
            "text": final.text[:300],
        }


EXPLORE = np.full(256, 1.0)  # how likely an exploring walk takes each byte
EXPLORE[0x80:] = 0.3
EXPLORE[list(b" \t\r\n")] = 0.05
EXPLORE[list(b'"]}')] = 8.0


def _in_string(out: bytearray) -> bool:
    """The JSON text `out` ends inside a string."""
    return len(re.findall(rb'(?<!\\)(?:\\\\)*"', bytes(out))) % 2 == 1


def _after(constraint: Any, token: int) -> Any:
    trial = constraint.fork()
    trial.accept(token)
    return trial


def _shown(schema: Any) -> Any:
    """`schema` itself, or the start of its text when it is too big or too deep to show."""
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except (RecursionError, ValueError):
        return "(too deep to print)"
    return schema if len(text) <= 2000 else text[:300] + "..."


def _bucket(message: str) -> str:
    """The reason a refusal gives, by the words of its message past the field and path."""
    message = re.sub(r"^.*?#\S*: ", "", message)
    for reason, words in REASONS:
        if any(w in message for w in words.split("|")):
            return reason
    return "other: " + message.split(":", 1)[-1].strip()[:60]


def smaller(value: Any) -> Iterator[Any]:
    """Each one-step simplification of a JSON value: a key or item dropped, or a child replaced
    by one of its own simplifications."""
    if isinstance(value, dict):
        for k in value:
            yield {j: v for j, v in value.items() if j != k}
        for k, v in value.items():
            for s in smaller(v):
                yield {**value, k: s}
    elif isinstance(value, list):
        for i in range(len(value)):
            yield value[:i] + value[i + 1 :]
        for i, v in enumerate(value):
            for s in smaller(v):
                yield value[:i] + [s] + value[i + 1 :]
    elif isinstance(value, str) and value:
        yield value[: len(value) // 2]


def shrink(value: Any, fails: Callable[[Any], bool], max_tries: int = 400) -> Any:
    """A smaller value that still `fails`, by greedy one-step simplification."""
    tries = 0
    progress = True
    while progress and tries < max_tries:
        progress = False
        for candidate in smaller(value):
            tries += 1
            if fails(candidate):
                value, progress = candidate, True
                break
            if tries >= max_tries:
                break
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http", type=int, default=0, help="cases sent to a real server too")
    parser.add_argument("--no-shrink", action="store_true")
    args = parser.parse_args()
    fuzz = SchemaFuzz()
    t0 = time.perf_counter()
    result = fuzz.run(args.cases, args.seed, not args.no_shrink)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    fuzz.close()
    if args.http:
        result["http"] = http_fuzz(args.http, args.seed)
    print(json.dumps(result, indent=1, ensure_ascii=False, default=str))


if __name__ == "__main__":
    main()
