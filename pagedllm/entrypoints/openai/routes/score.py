"""/score, /v1/score (text-pair similarity) and /rerank, /v1/rerank, /v2/rerank on an embedding server."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol_embeddings import RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.server_state import State
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore

router = APIRouter()


def _handler(state: State) -> OpenAIServingScore:
    return state.handler("score")  # a 400 naming the served endpoints on a generation server


@router.post("/score")
@router.post("/v1/score")
async def create_score(
    raw_request: Request,
    handler: Annotated[OpenAIServingScore, Depends(_handler)],
    request: Annotated[ScoreRequest, typed_body(ScoreRequest)],
) -> Response:
    return await handler.create_score(request, raw_request)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(
    raw_request: Request,
    handler: Annotated[OpenAIServingScore, Depends(_handler)],
    request: Annotated[RerankRequest, typed_body(RerankRequest)],
) -> Response:
    return await handler.create_rerank(request, raw_request)
