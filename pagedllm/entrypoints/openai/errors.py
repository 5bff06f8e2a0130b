"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int = 400, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or _TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None, err_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying an OpenAI-style error body; the message says what to change."""
    return JSONResponse(error_body(message, status, param, err_type), status_code=status, headers=headers)


class RequestParamError(ValueError):
    """A ValueError about one request field: the 400 names ``param``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param
