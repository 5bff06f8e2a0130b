"""POST /v1/embeddings: one engine pooling request per input, run together (they batch in the
engine's steps); the body lists the embeddings in input order, as floats or base64."""

from __future__ import annotations

import asyncio
import base64
from array import array
from collections.abc import Coroutine
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.auth import quota_ticket
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIServing,
    now_s,
    random_id,
    until_disconnected,
)
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    prompt_param = "input"
    id_prefix = "embd"

    def __init__(
        self, engine: EngineClient, models: ServedModels, prompt_limit: tuple[int, str] = (256, "the default")
    ) -> None:
        super().__init__(engine, models)
        self.max_prompts, self.max_prompts_reason = prompt_limit  # ServerOptions.prompt_limit

    def check_count(self, count: int, what: str, param: str) -> None:
        """Each input is an engine request: a request may hold no more than the server's limit."""
        if count > self.max_prompts:
            raise RequestParamError(
                f"{param} holds {count} {what}; this server takes at most {self.max_prompts} in one request "
                f"({self.max_prompts_reason}): split them into several requests",
                param,
            )

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        return await self.answer(request, self._embeddings(request, raw_request))

    async def answer(self, request: Any, body: Coroutine[Any, Any, dict]) -> Response:
        """The JSON body ``body`` makes, or the error it raises: a client that hung up 499, bad
        input 400 (OpenAI's error body), anything else 500."""
        try:
            return JSONResponse(await body)
        except Exception as exc:
            return self.failure_response(exc, request)

    async def _embeddings(self, request: EmbeddingRequest, raw_request: Request) -> dict:
        self.check_count(len(request.inputs()), "inputs", "input")
        params = request.to_pooling_params()
        prompts = [self._engine_prompt(p, request) for p in request.inputs()]
        outputs = await until_disconnected(self._embed_all(prompts, params, request.priority, raw_request), raw_request)
        return self._body(request, outputs)

    def _engine_prompt(self, prompt: str | list[int], request: EmbeddingRequest) -> Any:
        if isinstance(prompt, str) and not request.add_special_tokens:
            return {
                "prompt": prompt,
                "prompt_token_ids": self.engine.tokenizer.encode(prompt, add_special_tokens=False),
            }
        return prompt

    async def _embed_all(
        self, prompts: list[Any], params: PoolingParams, requested_priority: int, raw_request: Request
    ) -> list[PoolingRequestOutput]:
        """Every input at once; one that fails (e.g. too long) cancels the others (they abort).
        They run as the API key's tenant, at most as urgent as the key allows (``_priority``)."""
        request_id = random_id(self.id_prefix)
        ticket = quota_ticket(raw_request.state)
        priority = self._priority(requested_priority, ticket)
        tenant = ticket.key.name if ticket is not None else None
        tasks = [
            asyncio.ensure_future(self._embed_one(prompt, params, f"{request_id}-{i}", priority, tenant))
            for i, prompt in enumerate(prompts)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _embed_one(
        self, prompt: Any, params: PoolingParams, request_id: str, priority: int, tenant: str | None
    ) -> PoolingRequestOutput:
        async with aclosing(self.engine.encode(prompt, params, request_id, priority, tenant)) as outputs:
            async for output in outputs:
                return output
        raise RuntimeError(f"the engine ended request {request_id} without an output")

    def _body(self, request: EmbeddingRequest, outputs: list[PoolingRequestOutput]) -> dict:
        data = []
        for index, output in enumerate(outputs):
            if output.outputs is None:
                raise RuntimeError(f"request {output.request_id} ended without an embedding ({output.finish_reason})")
            data.append({"index": index, "object": "embedding", "embedding": _encode(output.outputs.raw, request)})
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {
            "id": self.response_id(request),
            "object": "list",
            "created": now_s(),
            "model": request.model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }


def _encode(raw: bytes, request: EmbeddingRequest) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes, as OpenAI sends them."""
    if request.encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return array("f", raw).tolist()
