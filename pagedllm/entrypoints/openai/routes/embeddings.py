"""POST /v1/embeddings (a server whose model runs the pooling runner)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.server_state import State
from pagedllm.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding

router = APIRouter()


def _handler(state: State) -> OpenAIServingEmbedding:
    return state.handler("embedding")  # a 400 naming the served endpoints on a generation server


@router.post("/v1/embeddings")
async def create_embedding(
    raw_request: Request,
    handler: Annotated[OpenAIServingEmbedding, Depends(_handler)],
    request: Annotated[EmbeddingRequest, typed_body(EmbeddingRequest)],
) -> Response:
    return await handler.create_embedding(request, raw_request)
