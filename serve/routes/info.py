"""Routes about the server and its model: `GET /health`, `GET /version`, `GET /metrics`
(Prometheus), and, guarded like inference, `GET /v1/models` (every served name),
`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` (vLLM's shapes; lm-eval reads
them to tokenize through the server)."""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from flipjax.model.shipped import DESCRIPTIONS as SHIPPED_DESCRIPTIONS
from flipjax.model.tiny import TINY_DESCRIPTION, TINY_NAME
from flipjax.model.tokenizer import ByteTokenizer, CheckpointTokenizer
from serve.auth import State, require_api_key
from serve.errors import bad_request
from serve.messages import ReadMemory, ReadStats
from serve.protocol.sampling import UNKNOWN_FIELDS
from serve.protocol.tokens import DetokenizeRequest, TokenizeRequest
from serve.state import ServerState

router = APIRouter(tags=["info"])
guarded = APIRouter(dependencies=[Depends(require_api_key)], tags=["info"])


@router.get("/health", response_model=None)
async def health(state: State) -> dict[str, str] | JSONResponse:
    """503 once the engine loop has stopped or a process of the cluster is lost, naming it
    (the server serves nothing more)."""
    if state.loop.dead is not None:
        body = {"status": "unavailable", "error": f"the engine loop stopped: {state.loop.dead}"}
        return JSONResponse(status_code=503, content=body)
    lost = state.loop.lost
    if lost is not None:
        body = {"status": "unavailable", "error": str(lost), "lost_processes": lost.lost}
        return JSONResponse(status_code=503, content=body)
    return {"status": "ok"}


@router.get("/version")
async def server_version() -> dict[str, str]:
    return {"version": version("flipjax")}


@router.get("/metrics")
async def prometheus(state: State) -> Response:
    stats = await asyncio.to_thread(state.loop.call, ReadStats())
    state.metrics.read_engine(stats)
    state.metrics.read_memory(await asyncio.to_thread(state.loop.call, ReadMemory()))
    grammars = state.grammars.counters if state.grammars is not None else {}
    state.metrics.read_server(UNKNOWN_FIELDS, grammars)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@guarded.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    info = state.info
    cards = []
    for name in state.served_names:
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "flipjax",
            "root": info.name,
            "max_model_len": info.max_model_len,
        }
        if info.name == TINY_NAME:
            card["description"] = TINY_DESCRIPTION
        elif info.name in SHIPPED_DESCRIPTIONS:
            card["description"] = SHIPPED_DESCRIPTIONS[info.name]
        cards.append(card)
    return {"object": "list", "data": cards}


@guarded.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State) -> dict[str, Any]:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: give exactly one of prompt and messages", "prompt")
    text = req.prompt
    if req.messages is not None:
        messages = [m.for_template() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
        try:
            text = state.template.render(
                messages,
                tools,
                req.add_generation_prompt,
                req.continue_final_message,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    tokenizer = state.info.tokenizer
    try:
        tokens = tokenizer.encode(text or "")
    except ValueError as err:
        raise bad_request(str(err), "prompt") from None
    out: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": state.info.max_model_len,
        "tokens": tokens,
    }
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return out


@guarded.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: State) -> dict[str, str]:
    state.check_model(req.model)
    vocab = state.info.model.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"tokens: ids {bad[:8]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    return {"prompt": state.info.tokenizer.decode(req.tokens)}


@guarded.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict[str, Any]:
    return {
        "tokenizer_class": type(state.info.tokenizer).__name__,
        "eos_token": _eos_text(state),
        "bos_token": None,
        "pad_token": None,
        "chat_template": state.template.source,
        "model_max_length": state.info.max_model_len,
    }


def _eos_text(state: ServerState) -> str | None:
    tokenizer = state.info.tokenizer
    eos = tokenizer.eos_token_id
    if eos is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        return ByteTokenizer.SPECIALS[eos - 256]
    if isinstance(tokenizer, CheckpointTokenizer):
        return tokenizer.backend.id_to_token(eos)
    return None
