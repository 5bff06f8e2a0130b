"""POST /tokenize and /detokenize: the engine's tokenizer, and chat rendering exactly as chat
completions render (same function, same template, tools and template kwargs)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter

from pagedllm.entrypoints.openai.errors import OpenAIError, value_error
from pagedllm.entrypoints.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.server_state import ServerState, State

router = APIRouter()


@router.post("/tokenize")
async def tokenize(state: State, request: Annotated[TokenizeRequest, typed_body(TokenizeRequest)]) -> dict:
    state.models.check(request.model)
    try:
        request.check_input()
        tokens = _tokenize(state, request)
    except ValueError as exc:  # a bad template or template kwargs: the client's to fix
        raise value_error(exc, request, "messages") from None
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.models.max_model_len}


@router.post("/detokenize")
async def detokenize(state: State, request: Annotated[DetokenizeRequest, typed_body(DetokenizeRequest)]) -> dict:
    state.models.check(request.model)
    vocab = state.engine.config.model_config.arch.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", 400, "tokens")
    return {"prompt": state.engine.tokenizer.decode(request.tokens)}


def _tokenize(state: ServerState, request: TokenizeRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    if request.prompt is not None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return list(tokenizer.encode(request.prompt, add_special_tokens=special))
    return request.render_chat_ids(tokenizer, state.options.chat_template, bool(request.add_special_tokens))
