"""POST /invocations: SageMaker's one inference route. The body is a chat completion request
(it has ``messages``) or a completion request (it has ``prompt``), handled exactly as on
/v1/chat/completions or /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.openapi import json_body_doc
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.request_body import json_object_body, parse_body
from pagedllm.entrypoints.openai.server_state import State

router = APIRouter()


@router.post("/invocations", openapi_extra=json_body_doc(ChatCompletionRequest, CompletionRequest))
async def invocations(raw_request: Request, state: State) -> Response:
    body = await json_object_body(raw_request)
    if "messages" in body:
        chat = parse_body(ChatCompletionRequest, body)
        return await state.chat().create_chat_completion(chat, raw_request)
    if "prompt" in body:
        completion = parse_body(CompletionRequest, body)
        return await state.completion().create_completion(completion, raw_request)
    raise OpenAIError(
        "/invocations takes a chat completion request (with 'messages') or a completion request (with 'prompt')",
        param="messages",
    )
