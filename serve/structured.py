"""Structured output for a request: which grammar it asks for, compiled off the engine thread.

A request names at most one of: `response_format` (`json_object`, or `json_schema` with its
schema), vLLM's `guided_json`, `guided_regex`, `guided_choice` or `guided_grammar`, or the same
in `structured_outputs`. The grammar compiles on a worker thread (cached by spec, so a schema
many requests share compiles once); the engine thread only fills each step's token bitmask.
An invalid spec is a 400 naming its field, and so is one too large or too deep to compile in
bounded time, or one whose compile outlasts `ServerState.grammar_timeout_s`; a compiler with
too many compiles pending answers 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from flipjax.runtime.constraint import TokenConstraint
from flipjax.runtime.grammar import GrammarBusy, GrammarCompiler
from serve.errors import APIError, bad_request, refusal
from serve.protocol.sampling import SamplingFields
from serve.state import ServerState

Spec = tuple[str, Any, str]  # (kind, spec, the request field it came from)


def specs_of(req: SamplingFields) -> list[Spec]:
    found: list[Spec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("json_object", None, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            field = "response_format.json_schema"
            raise bad_request(f"{field}: required for type json_schema", field)
        found.append(("json", rf.json_schema.json_schema, "response_format.json_schema"))
    so = req.structured_outputs
    guided = {
        "json": req.guided_json,
        "regex": req.guided_regex,
        "choice": req.guided_choice,
        "grammar": req.guided_grammar,
    }
    for kind, spec in guided.items():
        if spec is not None:
            found.append((kind, spec, f"guided_{kind}"))
    if so is not None:
        nested = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        found += [(k, v, f"structured_outputs.{k}") for k, v in nested.items() if v is not None]
        if so.json_object:
            found.append(("json_object", None, "structured_outputs.json_object"))
    return found


async def compile_spec(state: ServerState, spec: Spec) -> Callable[[], TokenConstraint]:
    """A maker of fresh constraints (one per request) for `spec`, compiled off the loop."""
    compiler = await _compiler(state)
    field = spec[2]
    try:
        # The compile runs on in the compiler's threads if this request gives up on it: its
        # C++ cannot be interrupted, and its result is cached for the next request.
        future = asyncio.wrap_future(compiler.submit(*spec))
        compiled = await asyncio.wait_for(asyncio.shield(future), state.config.grammar_timeout_s)
    except ValueError as err:
        raise refusal(err) from None
    except GrammarBusy as err:
        raise APIError(503, str(err), field, "server_busy") from None
    except TimeoutError:
        compiler.counters["timed_out"] += 1
        limit = state.config.grammar_timeout_s
        message = f"{field}: the grammar did not compile within {limit:g} s"
        raise bad_request(message, field) from None
    return lambda: compiler.constraint(compiled)


async def grammar_for(
    state: ServerState, req: SamplingFields, extra: Spec | None = None
) -> Callable[[], TokenConstraint] | None:
    """The request's structured output (with `extra`, the route's own, e.g. forced tool
    calls), or None; two at once are refused."""
    found = specs_of(req) + ([extra] if extra is not None else [])
    if len(found) > 1:
        fields = ", ".join(f for _, _, f in found)
        raise bad_request(
            f"{found[1][2]}: only one structured output at a time ({fields})", found[1][2]
        )
    return await compile_spec(state, found[0]) if found else None


async def _compiler(state: ServerState) -> GrammarCompiler:
    async with state.grammar_lock:
        if state.grammars is None:
            info = state.info
            try:
                state.grammars = await asyncio.to_thread(
                    GrammarCompiler,
                    info.tokenizer,
                    info.model.vocab_size,
                    state.config.any_whitespace,
                )
            except ValueError as err:
                raise refusal(err) from None
        return state.grammars
