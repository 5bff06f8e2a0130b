"""POST /v1/responses, GET /v1/responses/{response_id}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.server_state import State
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

router = APIRouter()


def _handler(state: State) -> OpenAIServingResponses:
    return state.handler("responses")  # a 501 before the body is read when this build has none


@router.post("/v1/responses")
async def create_response(
    raw_request: Request,
    handler: Annotated[OpenAIServingResponses, Depends(_handler)],
    request: Annotated[ResponsesRequest, typed_body(ResponsesRequest)],
) -> Response:
    return await handler.create_response(request, raw_request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: str, handler: Annotated[OpenAIServingResponses, Depends(_handler)]
) -> JSONResponse:
    return JSONResponse(handler.retrieve(response_id))
