"""POST /tokenize and /detokenize: the engine's tokenizer, and chat rendering exactly as chat
completions render (the chat handler's own ``render``: same template, tools, template kwargs and
``continue_final_message``); GET /tokenizer_info with --enable-tokenizer-info-endpoint."""

from __future__ import annotations

from typing import Annotated, Any

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
    body: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": state.models.max_model_len}
    if request.return_token_strs:
        body["token_strs"] = state.engine.tokenizer.convert_ids_to_tokens(tokens)
    return body


@router.post("/detokenize")
async def detokenize(state: State, request: Annotated[DetokenizeRequest, typed_body(DetokenizeRequest)]) -> dict:
    state.models.check(request.model)
    vocab = state.engine.config.model_config.arch.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", 400, "tokens")
    return {"prompt": state.engine.tokenizer.decode(request.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict:
    """The tokenizer's configuration (its ``tokenizer_config.json`` fields, file paths left out),
    its class and the chat template the server renders with."""
    if not state.options.enable_tokenizer_info_endpoint:
        raise OpenAIError("/tokenizer_info is off; start the server with --enable-tokenizer-info-endpoint", 404)
    tokenizer = state.engine.tokenizer
    config = {k: _jsonable(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(key, None)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = state.options.chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _jsonable(value: Any) -> Any:
    """Tokenizer config values as JSON: special tokens (``AddedToken``) by their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _tokenize(state: ServerState, request: TokenizeRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    if request.prompt is not None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return list(tokenizer.encode(request.prompt, add_special_tokens=special))
    return state.chat().render(request)[1]
