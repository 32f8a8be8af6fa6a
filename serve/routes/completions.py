"""`POST /v1/completions` and flipjax's token-level `POST /generate`.

A completion takes one prompt or several (strings or token ids), `n` choices each, sharing
their prompt's prefill; `best_of` samples that many and keeps the `n` with the highest
cumulative logprob, as vLLM does. `echo` returns the prompt first, with `max_tokens: 0` only
the prompt and its logprobs (how lm-eval scores multiple-choice tasks).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flipjax.engine.engine import Output
from serve.auth import State, require_api_key
from serve.errors import bad_request
from serve.limits import check_choices
from serve.messages import NewRequest
from serve.protocol.completions import CompletionRequest, GenerateRequest
from serve.render_completion import CompletionRenderer
from serve.streaming import sse
from serve.structured import grammar_for
from serve.submission import Submitted, collect, submit

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["inference"])


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, state: State) -> Response:
    state.check_model(req.model)
    if req.suffix is not None:
        raise bad_request("suffix: flipjax serves no fill-in-the-middle model", "suffix")
    prompts = req.prompts()
    if not prompts:
        raise bad_request("prompt: is empty", "prompt")
    best_of = req.best_of or req.n
    check_choices(req.n, "n", state.config.max_n)
    check_choices(best_of, "best_of", state.config.max_n)
    if best_of < req.n:
        raise bad_request(f"best_of: {best_of} is below n {req.n}", "best_of")
    if req.stream and best_of > req.n:
        raise bad_request("best_of: cannot stream when best_of exceeds n", "best_of")
    k, ranked = req.logprobs, best_of > req.n
    scored = req.echo and (k is not None or req.max_tokens == 0)
    params = req.sampling_params(
        logprobs=k if k is not None else (0 if ranked else None),
        prompt_logprobs=(k or 0) if scored else None,
    )
    grammar = await grammar_for(state, req)

    requests = [
        NewRequest(
            prompt,
            params,
            session_id=req.session_id,
            n=best_of,
            grammar=grammar() if grammar is not None else None,
            cache_salt=req.cache_salt,
        )
        for prompt in prompts
    ]
    submitted = await submit(state, requests)
    tokenizer = state.info.tokenizer
    echo = [_echoed(tokenizer, p) for p in prompts] if req.echo else None
    cid = f"cmpl-{submitted.choices[0].request_id}"
    renderer = CompletionRenderer(cid, state.model_name, tokenizer, k, echo)
    if req.stream:
        events = sse(state, submitted, renderer, list(params.stop), req.stream_options)
        return StreamingResponse(events, media_type="text/event-stream")
    outputs = await collect(state, submitted)
    if ranked:
        submitted, outputs = _best(submitted, outputs, req.n)
    return JSONResponse(renderer.body(submitted, outputs))


def _echoed(tokenizer: Any, prompt: str | list[int]) -> tuple[str, list[int]]:
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    return tokenizer.decode(prompt), list(prompt)


def _best(submitted: Submitted, outputs: list[Output], n: int) -> tuple[Submitted, list[Output]]:
    """Each prompt's `n` choices with the highest cumulative logprob, renumbered."""
    kept: list[tuple[Any, Output]] = []
    for prompt in sorted({c.prompt for c in submitted.choices}):
        pairs = [
            (c, o) for c, o in zip(submitted.choices, outputs, strict=True) if c.prompt == prompt
        ]
        pairs.sort(key=lambda p: -sum(lp.logprob for lp in p[1].logprobs or []))
        kept += pairs[:n]
    choices = [type(c)(i, c.request_id, c.prompt, c.prompt_tokens) for i, (c, _) in enumerate(kept)]
    return Submitted(choices, submitted.updates, submitted.sampling), [o for _, o in kept]


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, state: State) -> Response:
    if req.stream:
        raise bad_request("stream: /generate answers once; use /v1/completions", "stream")
    params = req.sampling_params()
    submitted = await submit(state, [NewRequest(req.input_ids, params)])
    out = (await collect(state, submitted))[0]
    body = {
        "request_id": out.request_id,
        "output_ids": out.token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "usage": submitted.final_usage([out]),
    }
    return JSONResponse(body)
