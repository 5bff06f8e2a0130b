"""Typed request bodies: a FastAPI dependency that reads the JSON body and validates it into the
route's pydantic model, mapping every failure to an OpenAI-style 400 that names the field.

A body must be sent as ``Content-Type: application/json`` (vLLM refuses other types too): a
browser can POST form-encoded or plain-text bodies to any site without a CORS preflight, so
accepting them would let any web page spend this server's compute. ``curl`` users add
``-H 'Content-Type: application/json'``.

A body larger than ``--max-request-body-bytes`` is refused with 413, from its Content-Length
before any of it is read, or as soon as a body streamed without one grows past the limit. The
parsed JSON is checked before any model sees it: nested at most ``MAX_JSON_DEPTH`` deep (deeper
JSON would exhaust Python's recursion limit in the parser or in whatever walks it later), and
no string holds a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but no valid text: the
tokenizer cannot encode it), and no integer is outside int64 (the engine's messages carry int64);
each is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagedllm.entrypoints.openai.errors import OpenAIError, validation_error
from pagedllm.entrypoints.openai.protocol_base import INT64_MAX, INT64_MIN

M = TypeVar("M", bound=BaseModel)
MAX_JSON_DEPTH = 64  # JSON schemas and tool parameters nest far less; Python's stack allows ~1000


async def json_object_body(raw_request: Request) -> dict:
    """The request body as a JSON object, or a 400 OpenAIError that says what is wrong."""
    media_type = raw_request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise OpenAIError(
            f"Unsupported Media Type {media_type or '(none)'!r}: only 'application/json' is allowed; send "
            "the body as JSON with the header 'Content-Type: application/json'",
            param="Content-Type",
        )
    limits = raw_request.app.state.server_state.options.limits
    raw = await read_body(raw_request, limits.max_request_body_bytes, limits.body_read_timeout)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise OpenAIError(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}")
    check_json_values(body)
    return body


async def read_body(raw_request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, or a 413 once it is (or says it will be) larger than ``limit`` bytes, or a
    408 when it has not all arrived within ``timeout`` seconds (None: no deadline)."""
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    try:
        async with asyncio.timeout(timeout):
            return await _stream_body(raw_request, limit)
    except ClientDisconnect:  # the client hung up first (under load, before its body was read)
        raise OpenAIError("the client closed the connection before its request body arrived", 499) from None
    except TimeoutError:
        raise OpenAIError(
            f"the request body did not all arrive within {timeout:g} s (this server's --body-read-timeout); "
            "send the whole body at once",
            408,
        ) from None


async def _stream_body(raw_request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in raw_request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(f"more than {limit} bytes", limit)
    return bytes(body)


def _too_large(size: str, limit: int) -> OpenAIError:
    return OpenAIError(
        f"the request body is too large ({size}; this server accepts at most {limit} bytes, "
        "its --max-request-body-bytes)",
        413,
    )


def check_json_values(body: dict) -> None:
    """A 400 naming the field if ``body`` nests deeper than MAX_JSON_DEPTH, a string (value or
    key) in it holds a lone surrogate, or an integer does not fit in int64 (the engine's messages
    carry int64: a bigger one would fail there, as a 500). Iterative: a deep body cannot
    overflow the check."""
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            field = _name(path[:1])
            raise OpenAIError(f"{field} is nested too deeply (at most {MAX_JSON_DEPTH} levels)", 400, field)
        if _in_range_ints(value):  # token ids: checked at C speed, not one by one
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:
                _int_out_of_range(item, (*path, key))
            elif isinstance(item, (str, dict, list)):
                stack.append((item, (*path, key), depth + 1))


def _in_range_ints(value: dict | list) -> bool:
    """``value`` is a long list of int64 integers only (short ones cost less one by one)."""
    return (
        isinstance(value, list)
        and len(value) > 64
        and all(type(item) is int for item in value)
        and min(value, default=0) >= INT64_MIN
        and max(value, default=0) <= INT64_MAX
    )


def _int_out_of_range(value: int, path: tuple) -> None:
    text = str(value)
    shown = text if len(text) <= 40 else f"{text[:37]}..."
    raise OpenAIError(
        f"{_name(path)}: integer {shown} is out of range: integers in a request must fit in a signed "
        f"64-bit integer [{INT64_MIN}, {INT64_MAX}]",
        400,
        _name(path),
    )


def _check_text(text: str, path: tuple) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OpenAIError(
                f"{_name(path)} holds a lone UTF-16 surrogate ({text[exc.start]!r} at character {exc.start}), "
                "which is not valid text: send well-formed Unicode (pair surrogates as \\ud83d\\ude00)",
                400,
                _name(path),
            ) from None


def _name(path: tuple) -> str:
    return ".".join(str(part) for part in path) or "body"


def parse_body(model: type[M], body: dict) -> M:
    """``body`` validated into ``model``; a 400 naming the offending field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False), body) from None


class _TypedBody:
    """The dependency ``typed_body`` makes; ``body_model`` is what openapi.py documents."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.body_model = model

    async def __call__(self, raw_request: Request) -> Any:
        return parse_body(self.body_model, await json_object_body(raw_request))


def typed_body(model: type[M]) -> Any:
    """``request: Annotated[ChatCompletionRequest, typed_body(ChatCompletionRequest)]`` in a route."""
    return Depends(_TypedBody(model))
