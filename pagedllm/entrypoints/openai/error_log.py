"""The last few error responses (4xx/5xx) the server sent, for the dashboard.

``ErrorRecorder`` is a pure ASGI middleware (streaming passes through untouched) placed
outermost, so it sees the API-key gate's 401s and the overload 503s too. It keeps the time,
method, path, status and the error body's ``message``: never a header, so never an API key.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

MAX_RECENT_ERRORS = 50
MAX_MESSAGE_CHARS = 300
_MAX_BODY_BYTES = 16 * 1024  # an error body is small; more is not parsed
_NO_BODY = {499: "the client closed the connection before the answer"}


@dataclass(frozen=True)
class ErrorEntry:
    time: float  # Unix time the response started
    method: str
    path: str
    status: int
    message: str


class RecentErrors:
    """A bounded log of error responses, newest last, with a count per status since start-up."""

    def __init__(self, maxlen: int = MAX_RECENT_ERRORS) -> None:
        self._entries: deque[ErrorEntry] = deque(maxlen=maxlen)
        self.counts: dict[int, int] = {}

    def add(self, method: str, path: str, status: int, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        self._entries.append(ErrorEntry(time.time(), method, path, status, message))
        self.counts[status] = self.counts.get(status, 0) + 1

    def recent(self, limit: int = MAX_RECENT_ERRORS) -> list[dict[str, Any]]:
        """The newest ``limit`` entries, newest first."""
        return [asdict(e) for e in list(self._entries)[::-1][:limit]]


def error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style body; else the body's start as text."""
    try:
        parsed = json.loads(body)
        return str(parsed["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:MAX_MESSAGE_CHARS].decode("utf-8", "replace")


class ErrorRecorder:
    """ASGI middleware: every response with status >= 400 is added to ``errors``."""

    def __init__(self, app: Any, errors: RecentErrors) -> None:
        self.app = app
        self.errors = errors

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0
        body = bytearray()

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < _MAX_BODY_BYTES:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # the app's last-resort handler answers it 500, outside this middleware
            self.errors.add(scope["method"], scope["path"], 500, f"internal server error ({type(exc).__name__})")
            raise
        if status >= 400:
            message = error_message(bytes(body)) or _NO_BODY.get(status, "(no body)")
            self.errors.add(scope["method"], scope["path"], status, message)
