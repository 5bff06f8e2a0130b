"""Timestamps of the moments only the engine core sees in a request's life (torch-free).

The front end derives vLLM's queue, prefill, decode and inference times from them: each event
is held here until the request's next ``EngineCoreOutput`` carries it out of the engine core.
"""

from __future__ import annotations

import time

from pagedllm.engine.protocol import EngineCoreEvent, EngineCoreEventType


class RequestEvents:
    """The events of each live request not yet sent to the front end, oldest first."""

    def __init__(self) -> None:
        self._pending: dict[str, list[EngineCoreEvent]] = {}

    def record(self, request_id: str, kind: EngineCoreEventType) -> None:
        """Stamp ``kind`` now, on the clock of ``EngineCoreOutputs.timestamp``."""
        self._pending.setdefault(request_id, []).append(EngineCoreEvent(kind, time.monotonic()))

    def take(self, request_id: str) -> list[EngineCoreEvent] | None:
        """The pending events, to send with the request's output now (None when there are none)."""
        return self._pending.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request is gone: its unsent events will never be wanted."""
        self._pending.pop(request_id, None)
