"""Every error the server answers, in one place: OpenAI-style bodies
``{"error": {"message", "type", "param", "code"}}``, the mapping of pydantic and ValueErrors to
400s that name the offending field, and the app's exception handlers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.openai.quotas import QuotaExceeded

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "rate_limit_exceeded",
    499: "ClientClosedRequest",  # nginx's code: the client hung up (no one reads this answer)
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union-branch loc parts


def error_body(
    message: str, status: int = 400, param: str | None = None, err_type: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPES.get(status) or HTTPStatus(status).phrase,
            "param": param,
            "code": code or status,
        }
    }


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    err_type: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    """A JSONResponse carrying an OpenAI-style error body; the message says what to change."""
    return JSONResponse(error_body(message, status, param, err_type, code), status_code=status, headers=headers)


def rate_limit_response(message: str, retry_after: int) -> JSONResponse:
    """A 429 as OpenAI sends it (code ``rate_limit_exceeded``), with ``Retry-After`` in seconds."""
    return error_response(message, 429, headers={"Retry-After": str(retry_after)}, code="rate_limit_exceeded")


class RequestParamError(ValueError):
    """A ValueError about one request field: the 400 names ``param``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class OpenAIError(Exception):
    """Raise anywhere in a route to answer with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status, self.param)


# ---------------------------------------------------------------------------------- bad input -> 400
def validation_error(errors: Iterable[Any], body: Any) -> OpenAIError:
    """Pydantic errors (of a request body) as a 400 naming the offending parameter."""
    errors = [{**e, "loc": tuple(p for p in e.get("loc", ()) if p != "body")} for e in errors]
    if not errors:
        return OpenAIError("invalid request body")
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
        return OpenAIError(f"the request body is not valid JSON ({detail})")
    first = ([e for e in errors if e["type"] == "value_error"] or errors)[0]
    param = _param_from_loc(first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    if not param:  # a model-level check: its message starts with the field it is about
        param = _param_from_message(message, set(body) if isinstance(body, dict) else set())
    elif first["type"] != "value_error":
        message = _type_error_message(first, [e for e in errors if e["loc"][:1] == first["loc"][:1]], body)
    return OpenAIError(message, 400, param)


def _type_error_message(first: dict, same_field: list[dict], body: Any) -> str:
    """'temperature: Input should be a valid number, got 'hot''; for a union (every branch
    failed), the whole value and the accepted shapes."""
    branches = sorted({str(e["loc"][1]) for e in same_field if len(e["loc"]) > 1 and isinstance(e["loc"][1], str)})
    if len(same_field) > 1 and branches:
        value = body.get(first["loc"][0]) if isinstance(body, dict) else first.get("input")
        return f"{first['loc'][0]}: invalid value {_short_repr(value)}; expected one of: {', '.join(branches)}"
    return f"{_param_from_loc(first['loc'])}: {first['msg']}, got {_short_repr(first.get('input'))}"


def value_error(exc: ValueError, request: BaseModel | None, prompt_param: str = "prompt") -> OpenAIError:
    """An engine/SamplingParams ValueError about ``request`` as a 400; the message says what to change."""
    message = str(exc)
    fields = set(request.model_fields_set) if request is not None else set()
    param = exc.param if isinstance(exc, RequestParamError) else _param_from_message(message, fields)
    if param is None:
        param = "max_tokens" if "max_tokens" in message else prompt_param if "prompt" in message else None
    if param == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"  # chat's newer name for it
    if param == "logprobs" and getattr(request, "top_logprobs", None) is not None:
        param = "top_logprobs"  # chat's name for the count
    return OpenAIError(message, 400, param)


def value_error_response(exc: ValueError, request: BaseModel | None, prompt_param: str = "prompt") -> JSONResponse:
    return value_error(exc, request, prompt_param).response()


def server_error_response(exc: Exception) -> JSONResponse:
    if not isinstance(exc, EngineDeadError):
        logger.exception("request failed", exc_info=exc)
    return error_response(f"{type(exc).__name__}: {exc}", 500)


def _param_from_loc(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_NAMES)]
    return ".".join(parts) or None


def _param_from_message(message: str, fields: set[str]) -> str | None:
    """'temperature must be >= 0' -> 'temperature' (only names the request could carry)."""
    match = re.match(r"(\w+)[ =]", message)
    known = {"max_tokens", "logprobs", "prompt_logprobs"} | fields
    return match.group(1) if match and match.group(1) in known else None


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------- handlers
def add_exception_handlers(app: FastAPI) -> None:
    """Whatever a route raises becomes an OpenAI-style body; a bug is a 500 that says so."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(QuotaExceeded, _quota_exceeded)
    app.add_exception_handler(Exception, _internal_error)


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors(), exc.body).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = {
        404: f"{request.method} {request.url.path} is not a route of this server",
        405: f"{request.url.path} does not accept {request.method}",
    }.get(exc.status_code, str(exc.detail))
    return error_response(message, exc.status_code, headers=getattr(exc, "headers", None))


async def _quota_exceeded(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, QuotaExceeded)
    return rate_limit_response(exc.message, exc.retry_after)


async def _engine_dead(request: Request, exc: Exception) -> JSONResponse:
    return error_response(f"the engine is not running: {exc}", 500)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(f"internal server error ({type(exc).__name__}); see the server log", 500)
