"""The server's front gate: API-key check, per-key quotas and overload shedding, as one pure
ASGI middleware.

A pure ASGI middleware (not ``BaseHTTPMiddleware``) so streaming responses pass through
untouched and the in-flight count drops only when a response has been fully sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.api_keys import ApiKey, KeyRing
from pagedllm.entrypoints.openai.errors import error_response, rate_limit_response
from pagedllm.entrypoints.openai.quotas import QuotaBook, QuotaExceeded, Ticket

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


def _bearer_token(scope: dict) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def quota_ticket(scope_state: Any) -> Ticket | None:
    """The request's quota ticket (``request.state``), set by the gate when API keys are on."""
    return getattr(scope_state, "quota_ticket", None)


class ServerGate:
    """Checks ``Authorization: Bearer`` on protected paths, the key's quotas, and sheds load.

    The matched key rides in the request's state (``api_key``); a generation request of a key
    gets a ``quota_ticket`` (quotas.py) there, held until its response has been fully sent, so
    the key's in-flight slot frees when the request ends, fails or its client goes away. Over a
    per-key limit: 429 + ``Retry-After``.

    ``load()`` returns how many generation requests are in flight (the engine's unfinished
    count, or the HTTP requests this gate let through, whichever is larger: streaming
    requests reach the engine only once their response starts). A new generation request is
    refused with 503 + ``Retry-After`` when ``load() >= max_load``. The count of requests let
    through lives on ``counter.in_flight`` (the server state, which ``/load`` reports).
    """

    def __init__(
        self,
        app,
        api_keys: list[ApiKey],
        max_load: int,
        engine_load: Callable[[], int],
        counter: Any,
        quotas: QuotaBook | None = None,
    ) -> None:
        self.app = app
        self.keys = KeyRing(api_keys)
        self.quotas = quotas or QuotaBook()
        self.max_load = max_load
        self.engine_load = engine_load
        self.counter = counter

    def load(self) -> int:
        return max(self.counter.in_flight, self.engine_load())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        key = self._key(scope) if self.keys else None
        if self.keys and path.startswith(PROTECTED_PREFIXES) and key is None:
            response = error_response(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        if scope["method"] != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        await self._admit(scope, receive, send, key)

    def _key(self, scope: dict) -> ApiKey | None:
        token = _bearer_token(scope)
        key = None if token is None else self.keys.match(token)
        if key is not None:
            scope.setdefault("state", {})["api_key"] = key
        return key

    async def _admit(self, scope, receive, send, key: ApiKey | None) -> None:
        """Overload first (a 503 costs the key nothing), then the key's quotas (429), then run."""
        if self.load() >= self.max_load:
            return await self._overloaded()(scope, receive, send)
        ticket = None
        if key is not None:
            try:
                ticket = self.quotas.admit(key)
            except QuotaExceeded as exc:
                return await rate_limit_response(exc.message, exc.retry_after)(scope, receive, send)
            scope.setdefault("state", {})["quota_ticket"] = ticket
        self.counter.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.in_flight -= 1
            if ticket is not None:
                ticket.release()

    def _overloaded(self) -> Any:
        return error_response(
            f"the server is overloaded ({self.load()} requests in flight, limit {self.max_load}); "
            f"retry after {RETRY_AFTER_S} s",
            503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
