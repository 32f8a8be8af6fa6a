"""Appending a sampled token to a request and deciding whether it is finished.

Stop strings are matched on the decoded text, so one that spans several tokens is caught; the
text is cut before it (token ids keep every generated token), as in vLLM.
"""

from __future__ import annotations

import time

from flipjax.engine.sequence import Sequence, TokenLogprob
from flipjax.model.tokenizer import Tokenizer


def append_token(
    seq: Sequence,
    token: int,
    logprob: TokenLogprob | None,
    tokenizer: Tokenizer,
    max_model_len: int,
) -> None:
    """Record `token`; set `seq.finish_reason` when a stop condition is met."""
    params = seq.params
    seq.output_ids.append(token)
    if logprob is not None:
        seq.logprobs.append(logprob)
    if seq.first_token_time is None:
        seq.first_token_time = time.perf_counter()

    if len(seq.output_ids) - seq.carried < params.min_tokens:
        # The sampler held EOS and the stop ids back; stop strings wait too, as in vLLM.
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len:
            seq.finish_reason = "length"
        return
    if (token in tokenizer.eos_token_ids and not params.ignore_eos) or (
        token in params.stop_token_ids
    ):
        seq.text = tokenizer.decode(seq.output_ids)
        seq.finish_reason = "stop"
        return
    if params.stop:
        previous = len(seq.text)
        seq.text = tokenizer.decode(seq.output_ids)
        # A new match can only end in the newly decoded part.
        search_from = max(0, previous - max(len(s) for s in params.stop))
        hits = [i for i in (seq.text.find(s, search_from) for s in params.stop) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
            seq.finish_reason = "stop"
            return
    if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
