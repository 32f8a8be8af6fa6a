"""Incremental detokenization for streams: never a broken UTF-8 character, never a stop string.

Each call decodes the request's whole output so far and releases only text that is final: a
trailing U+FFFD (bytes of a character not yet complete) is held back, and so is any tail that
could still grow into one of the request's stop strings (the engine trims a matched stop from
the final text, so a released prefix of it could not be taken back). When the request finishes,
the engine's final text is authoritative and the rest of it is released.
"""

from __future__ import annotations

from flipjax.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def update(self, token_ids: list[int]) -> str:
        """New final text after the output grew to `token_ids`."""
        text = self.tokenizer.decode(token_ids)
        end = len(text)
        while end and text[end - 1] == _INCOMPLETE:
            end -= 1
        end = max(len(self.sent), end - self.hold)
        if not text[:end].startswith(self.sent):  # a tokenizer re-spelled earlier text: wait
            return ""
        return self._release(text[:end])

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text."""
        if not final_text.startswith(self.sent):  # `hold` covers the stops, so this is a bug
            raise RuntimeError(f"stream released {self.sent!r}; final text is {final_text!r}")
        return self._release(final_text)

    def _release(self, text: str) -> str:
        delta = text[len(self.sent) :]
        self.sent = text
        return delta
