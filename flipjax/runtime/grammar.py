"""Structured output with xgrammar: grammars compiled once per spec, matchers per request.

`GrammarCompiler` turns a spec (a JSON schema, any JSON object, a regex, a list of choices, an
EBNF grammar) into an xgrammar `CompiledGrammar` for the model's tokenizer, caching by spec, so
a schema used by many requests compiles once. A JSON schema is checked first
(`flipjax.runtime.json_schema`): what xgrammar would not enforce is refused by name. Compiling
is slow next to a step, so callers run it off the engine thread. `GrammarConstraint` is the
`TokenConstraint` a request carries: each step it fills the bitmask of the tokens the grammar
allows next (never one that breaks UTF-8: `utf8_guard`), and it advances past the token
the sampler chose. Once the grammar is complete only the stop tokens are allowed (for a model
without one, the grammar's completion ends the request).

xgrammar imports torch, so it loads on the first compiler made (`xgrammar()`), and only the
server imports this module; the engine sees the protocol in
`flipjax.runtime.constraint`.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from flipjax.model.tokenizer import ByteTokenizer, CheckpointTokenizer, Tokenizer
from flipjax.runtime.fault_handlers import fatal_signal_handlers_kept
from flipjax.runtime.json_schema import prepare_schema
from flipjax.runtime.sampler import bitmask_words
from flipjax.runtime.utf8_guard import Utf8Guard

if TYPE_CHECKING:
    import xgrammar as xgr

_loading = threading.Lock()

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# A string character in xgrammar's EBNF for minLength/maxLength strings, and in its own
# unbounded JSON strings (which exclude U+0000..U+001F, as RFC 8259 requires).
_LOOSE_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\\r\n]"
# A spec's text, and how deeply its objects, arrays and groups nest. xgrammar's compile time
# grows about cubically with a schema's depth (450 levels: 19 s; 2000: minutes), and its C++ code
# cannot be interrupted, so a spec past these is refused before it compiles. Real schemas are a
# few KiB and nest under 20 levels; vLLM and OpenAI state no limit.
MAX_SPEC_BYTES = 64 << 10
MAX_SPEC_DEPTH = 64
# Compiles queued or running at once; one more is refused (busy) rather than queued unseen.
MAX_PENDING_COMPILES = 16


@functools.cache
def xgrammar() -> ModuleType:
    """xgrammar, loaded on first use: it brings torch, about 2.5 s that a server start or an
    engine without structured output should not pay. The one place flipjax loads it, so that a
    fault in the process still ends it with a report instead of a hang (`fault_handlers`)."""
    with _loading, fatal_signal_handlers_kept():
        import xgrammar

    return xgrammar


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it: every token id's bytes, and the stop tokens."""
    xgr = xgrammar()
    stop = sorted(tokenizer.eos_token_ids) or None
    if isinstance(tokenizer, ByteTokenizer):
        # Byte ids are themselves; special tokens are empty strings, never allowed by a grammar.
        vocab = [bytes([i]) for i in range(256)] + [b""] * len(ByteTokenizer.SPECIALS)
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop
        )
    if isinstance(tokenizer, CheckpointTokenizer):
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stop)
    raise ValueError("response_format: structured output needs the checkpoint's tokenizer.json")


class GrammarBusy(RuntimeError):
    """More compiles are pending than the compiler takes; the request may come back later."""


def spec_text(spec: Any) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec)


def nesting_depth(text: str) -> int:
    """How deeply brackets ({[ nest in `text`, outside double-quoted strings and escapes: a
    JSON schema's objects and arrays, a regex's or an EBNF grammar's groups. A scan, not a
    parse, so no depth overflows Python's stack."""
    depth = deepest = 0
    quoted = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def check_spec(text: str, kind: str, field: str) -> None:
    """ValueError naming `field` and the limit when a spec is too large or too deep to compile
    in bounded time."""
    size = len(text.encode())
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"{field}: the {kind} spec is {size} bytes; at most {MAX_SPEC_BYTES}")
    depth = nesting_depth(text)
    if depth > MAX_SPEC_DEPTH:
        raise ValueError(
            f"{field}: the {kind} spec nests {depth} levels deep; at most {MAX_SPEC_DEPTH}"
        )


class GrammarCompiler:
    """Compiles on its own threads (`submit`), apart from every other executor, so slow compiles
    hold up only other compiles, and at most `max_pending` of those."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        any_whitespace: bool = True,
        capacity: int = 256,
        threads: int = 2,
        max_pending: int = MAX_PENDING_COMPILES,
    ):
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        # Without an end-of-sequence token a request ends when its grammar is complete.
        self.stop_free = tokenizer.eos_token_id is None
        self.capacity = capacity
        info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgrammar().GrammarCompiler(info, max_threads=threads)
        self.guard = Utf8Guard(info.decoded_vocab, vocab_size)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()  # compiled, hits, shared, refused, too_large, busy
        self.max_pending = max_pending
        # By spec and field, so that a refusal names the field its own request used.
        self._pending: dict[tuple[str, str, str], Future[xgr.CompiledGrammar]] = {}
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="flipjax-grammar")

    def compile(self, kind: str, spec: Any, field: str = "response_format") -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, waiting for it; ValueError naming `field` when it is
        not valid."""
        return self.submit(kind, spec, field).result()

    def submit(
        self, kind: str, spec: Any, field: str = "response_format"
    ) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, as a future: done at once when cached, shared with a
        compile of the same spec in flight, else queued on the compiler's threads. A spec out
        of bounds raises ValueError (naming `field`), and `GrammarBusy` when `max_pending`
        compiles are already waiting; either way nothing is queued."""
        if kind not in KINDS:
            raise ValueError(f"{field}: unknown structured output kind {kind!r}")
        if spec is not None:
            try:
                check_spec(spec_text(spec), kind, field)
            except RecursionError:  # a spec object too deep to write out as text
                self.counters["too_large"] += 1
                message = f"{field}: the {kind} spec nests more than {MAX_SPEC_DEPTH} levels deep"
                raise ValueError(message) from None
            except ValueError:
                self.counters["too_large"] += 1
                raise
        key = (kind, json.dumps(spec, sort_keys=True))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.counters["hits"] += 1
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(self._cache[key])
                return done
            if (*key, field) in self._pending:
                self.counters["shared"] += 1
                return self._pending[(*key, field)]
            if len(self._pending) >= self.max_pending:
                self.counters["busy"] += 1
                raise GrammarBusy(
                    f"{field}: {len(self._pending)} grammars are compiling, the most this "
                    f"server takes at once; try again shortly"
                )
            future = self._threads.submit(self._compile_cached, key, kind, spec, field)
            self._pending[(*key, field)] = future
        future.add_done_callback(lambda _: self._forget((*key, field)))
        return future

    def _forget(self, pending: tuple[str, str, str]) -> None:
        with self._lock:
            self._pending.pop(pending, None)

    def _compile_cached(
        self, key: tuple[str, str], kind: str, spec: Any, field: str
    ) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile(kind, spec)
        except (RuntimeError, ValueError, TypeError) as err:
            self.counters["refused"] += 1
            reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(err)).strip()  # drop the C++ site
            raise ValueError(f"{field}: invalid {kind}: {reason}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            self.counters["compiled"] += 1
        return compiled

    def _compile(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        c = self._compiler
        if kind == "json":
            grammar = xgrammar().Grammar.from_json_schema(
                json.dumps(prepare_schema(spec)), any_whitespace=self.any_whitespace
            )
            # xgrammar's length-bounded strings admit raw control characters, which strict
            # JSON parsers (Python's json.loads among them) refuse; its unbounded strings do not.
            return c.compile_grammar(str(grammar).replace(_LOOSE_CHAR, _JSON_CHAR))
        if kind == "json_object":  # OpenAI's JSON mode: any JSON object
            return self._compile("json", {"type": "object"})
        if kind == "regex":
            return c.compile_regex(_text(spec, kind))
        if kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(s, str) for s in spec):
                raise ValueError("choices must be a non-empty list of strings")
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "grammar":
            return c.compile_grammar(_text(spec, kind))
        return c.compile_structural_tag(spec if isinstance(spec, str) else json.dumps(spec))

    def constraint(self, compiled: xgr.CompiledGrammar) -> GrammarConstraint:
        matcher = xgrammar().GrammarMatcher(compiled, terminate_without_stop_token=self.stop_free)
        return GrammarConstraint(matcher, self.vocab_size, self.guard)


def _text(spec: Any, kind: str) -> str:
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a {kind} must be a non-empty string")
    return spec


class GrammarConstraint:
    """One request's position in its grammar (a `TokenConstraint`)."""

    def __init__(
        self, matcher: xgr.GrammarMatcher, vocab_size: int, guard: Utf8Guard, utf8: int = 0
    ):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.guard = guard
        self._utf8 = utf8  # where the text stands in its last character (`utf8_guard.STATES`)
        self._mask = np.zeros((1, bitmask_words(vocab_size)), np.int32)

    def next_mask(self) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self._mask)
        return self.guard.narrow(self._mask[0], self._utf8)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise RuntimeError(f"grammar: token {token} was sampled against the mask")
        self._utf8 = self.guard.advance(self._utf8, token)

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.fork(), self.vocab_size, self.guard, self._utf8)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()
