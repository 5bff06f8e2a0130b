"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.server_state import State
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

router = APIRouter()


def _handler(state: State) -> OpenAIServingChat:
    return state.chat()  # a 501 before the body is read when this build has no chat handler


@router.post("/v1/chat/completions")
async def create_chat_completion(
    raw_request: Request,
    handler: Annotated[OpenAIServingChat, Depends(_handler)],
    request: Annotated[ChatCompletionRequest, typed_body(ChatCompletionRequest)],
) -> Response:
    return await handler.create_chat_completion(request, raw_request)
