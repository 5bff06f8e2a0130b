"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.server_state import State
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

router = APIRouter()


def _handler(state: State) -> OpenAIServingCompletion:
    return state.completion()  # a 501 before the body is read when this build has no completion handler


@router.post("/v1/completions")
async def create_completion(
    raw_request: Request,
    handler: Annotated[OpenAIServingCompletion, Depends(_handler)],
    request: Annotated[CompletionRequest, typed_body(CompletionRequest)],
) -> Response:
    return await handler.create_completion(request, raw_request)
