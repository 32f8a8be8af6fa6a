"""Incremental detokenization for streams: never a broken UTF-8 character, never a stop string.

Each update decodes only a short window of the newest tokens: the tokens since the last text
that came out whole, plus the ones before them for context (a tokenizer may spell a token
differently after another), so a long stream costs linear time, not quadratic. Text is final
once the window decodes without a trailing U+FFFD (bytes of a character not yet complete).
Any final tail that could still grow into one of the request's stop strings is held back too
(the engine trims a matched stop from the final text, so a released prefix of it could not be
taken back). When the request finishes, the engine's final text is authoritative and the rest
of it is released.
"""

from __future__ import annotations

from flipjax.model.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded text that is whole
        self.sent = ""  # the part of it released
        self._prefix = 0  # window start: context tokens already decoded into `text`
        self._read = 0  # tokens decoded into `text`

    def update(self, new_ids: list[int]) -> str:
        """New final text after the output grew by `new_ids`."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read])
        window = decode(self.ids[self._prefix :])
        if len(window) > len(before) and not window.endswith(_INCOMPLETE):
            self.text += window[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        end = max(len(self.sent), len(self.text) - self.hold)
        return self._release(self.text[:end])

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text."""
        if not final_text.startswith(self.sent):  # `hold` covers the stops, so this is a bug
            raise RuntimeError(f"stream released {self.sent!r}; final text is {final_text!r}")
        return self._release(final_text)

    def _release(self, text: str) -> str:
        delta = text[len(self.sent) :]
        self.sent = text
        return delta
