"""Typed request bodies: a FastAPI dependency that reads the JSON body and validates it into the
route's pydantic model, mapping every failure to an OpenAI-style 400 that names the field.

A body must be sent as ``Content-Type: application/json`` (vLLM refuses other types too): a
browser can POST form-encoded or plain-text bodies to any site without a CORS preflight, so
accepting them would let any web page spend this server's compute. ``curl`` users add
``-H 'Content-Type: application/json'``.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError, validation_error

M = TypeVar("M", bound=BaseModel)


async def json_object_body(raw_request: Request) -> dict:
    """The request body as a JSON object, or a 400 OpenAIError that says what is wrong."""
    media_type = raw_request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise OpenAIError(
            f"Unsupported Media Type {media_type or '(none)'!r}: only 'application/json' is allowed; send "
            "the body as JSON with the header 'Content-Type: application/json'",
            param="Content-Type",
        )
    raw = await raw_request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_body(model: type[M], body: dict) -> M:
    """``body`` validated into ``model``; a 400 naming the offending field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False), body) from None


def typed_body(model: type[M]) -> Any:
    """``request: Annotated[ChatCompletionRequest, typed_body(ChatCompletionRequest)]`` in a route."""

    async def dependency(raw_request: Request) -> M:
        return parse_body(model, await json_object_body(raw_request))

    return Depends(dependency)
