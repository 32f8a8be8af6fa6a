"""The `text_completion` shapes: the whole answer, and the stream's chunks (a `Renderer`).

With `echo`, each choice's text starts with its prompt, and its logprobs with the prompt's
(the first prompt token has none). Every choice carries `token_ids`, flipjax's extra.
"""

from __future__ import annotations

import time
from typing import Any

from flipjax.engine.engine import Output
from flipjax.model.tokenizer import Tokenizer
from serve.logprobs import CompletionLogprobs, merge
from serve.messages import Update
from serve.streaming import ChoiceStream
from serve.submission import Submitted


class CompletionRenderer:
    def __init__(
        self,
        cid: str,
        model: str,
        tokenizer: Tokenizer,
        logprobs: int | None,
        echo: list[tuple[str, list[int]]] | None,  # per prompt: its text and its token ids
    ):
        self.cid = cid
        self.model = model
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.echo = echo
        self.created = int(time.time())

    def body(self, submitted: Submitted, outputs: list[Output]) -> dict[str, Any]:
        choices = []
        for c, out in zip(submitted.choices, outputs, strict=True):
            logs = CompletionLogprobs(self.tokenizer, self.logprobs or 0)
            text, blocks = self._prompt(c.prompt, out.prompt_logprobs, logs)
            if self.logprobs is not None:
                blocks.append(logs.block(out.token_ids, list(out.logprobs or [])))
            choices.append(
                {
                    "index": c.index,
                    "text": text + out.text,
                    "logprobs": merge(blocks) if self.logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                    "token_ids": out.token_ids,
                }
            )
        return self._wrap("text_completion", choices, submitted.final_usage(outputs))

    def delta(self, c: ChoiceStream, update: Update) -> dict[str, Any] | None:
        text, blocks = self._start(c, update.prompt_logprobs)
        text += c.text.update(update.new_ids)
        if self.logprobs is not None:
            blocks.append(self._logs(c).block(update.new_ids, update.new_logprobs))
        if not text and not blocks:
            return None
        return self._part(c, text, blocks, None)

    def last(self, c: ChoiceStream, out: Output) -> dict[str, Any]:
        text, blocks = self._start(c, out.prompt_logprobs)
        text += c.text.finish(out.text)
        if self.logprobs is not None:
            rest = out.token_ids[c.tokens :]
            blocks.append(self._logs(c).block(rest, list(out.logprobs or [])[c.tokens :]))
        return self._part(c, text, blocks, out.finish_reason)

    def chunk(self, parts: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return self._wrap("text_completion", parts, usage)

    # -- internals ------------------------------------------------------------------------------

    def _start(self, c: ChoiceStream, prompt_lps: list[Any] | None) -> tuple[str, list[Any]]:
        """The echoed prompt, in a choice's first delta only."""
        if c.started:
            return "", []
        return self._prompt(c.choice.prompt, prompt_lps, self._logs(c))

    def _prompt(
        self, prompt: int, prompt_lps: list[Any] | None, logs: CompletionLogprobs
    ) -> tuple[str, list[dict[str, Any]]]:
        if self.echo is None:
            return "", []
        text, ids = self.echo[prompt]
        blocks = []
        if self.logprobs is not None:
            entries = prompt_lps if prompt_lps is not None else [None] * len(ids)
            blocks.append(logs.block(ids, entries))
        return text, blocks

    def _logs(self, c: ChoiceStream) -> CompletionLogprobs:
        if "logprobs" not in c.state:
            c.state["logprobs"] = CompletionLogprobs(self.tokenizer, self.logprobs or 0)
        return c.state["logprobs"]

    def _part(
        self, c: ChoiceStream, text: str, blocks: list[Any], finish: str | None
    ) -> dict[str, Any]:
        logprobs = merge(blocks) if self.logprobs is not None else None
        return {
            "index": c.choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def _wrap(
        self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = {
            "id": self.cid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return body if usage is None else {**body, "usage": usage}
