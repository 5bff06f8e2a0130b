"""The server's front gate: API-key check and overload shedding, as one pure ASGI middleware.

A pure ASGI middleware (not ``BaseHTTPMiddleware``) so streaming responses pass through
untouched and the in-flight count drops only when a response has been fully sent.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.openai.errors import error_response

# The API docs too: the schema lists every route and field of this build.
PROTECTED_PREFIXES = (
    "/v1/",
    "/v2/",
    "/score",
    "/rerank",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/invocations",
    "/docs",
    "/redoc",
    "/openapi",
    "/dashboard/",  # the stats the page polls (the page itself holds no data)
    "/debug/",
)
# Requests that run the model: admitted under the load limit (embeddings and scores too).
GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/invocations",
    "/v1/embeddings",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
RETRY_AFTER_S = 1


def load_api_keys(keys: list[str] | None, key_file: str | None) -> list[str]:
    """Keys from ``--api-key`` (repeatable) and ``--api-key-file`` (one per line; # comments)."""
    found = [k.strip() for k in keys or [] if k.strip()]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read --api-key-file {key_file!r}: {exc.strerror}") from None
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file {key_file!r} holds no keys (one key per line)")
        found += file_keys
    return found


def key_matches(given: str, keys: list[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit on the first match)."""
    given_b = given.encode()
    result = False
    for key in keys:
        result |= hmac.compare_digest(given_b, key)
    return result


def _bearer_token(scope: dict) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class ServerGate:
    """Checks ``Authorization: Bearer`` on protected paths and sheds generation load.

    ``load()`` returns how many generation requests are in flight (the engine's unfinished
    count, or the HTTP requests this gate let through, whichever is larger: streaming
    requests reach the engine only once their response starts). A new generation request is
    refused with 503 + ``Retry-After`` when ``load() >= max_load``. The count of requests let
    through lives on ``counter.in_flight`` (the server state, which ``/load`` reports).
    """

    def __init__(self, app, api_keys: list[str], max_load: int, engine_load: Callable[[], int], counter: Any) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_load = max_load
        self.engine_load = engine_load
        self.counter = counter

    def load(self) -> int:
        return max(self.counter.in_flight, self.engine_load())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.keys and path.startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
            response = error_response(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        if scope["method"] != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        await self._admit(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        token = _bearer_token(scope)
        return token is not None and key_matches(token, self.keys)

    async def _admit(self, scope, receive, send) -> None:
        if self.load() >= self.max_load:
            response = error_response(
                f"the server is overloaded ({self.load()} requests in flight, limit {self.max_load}); "
                f"retry after {RETRY_AFTER_S} s",
                503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            return await response(scope, receive, send)
        self.counter.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.in_flight -= 1
