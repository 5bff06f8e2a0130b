"""uvicorn's h11 protocol with a deadline on the request head (slowloris guard).

uvicorn times out an idle keep-alive connection (``timeout_keep_alive``) but not one that is
sending its request line and headers: a client that opens connections and trickles header bytes
holds them forever. Here a connection's head must be complete within ``header_timeout_s`` of the
connection opening, or of the first byte of its next request on a kept-alive connection; the
deadline is not moved by further bytes, so trickling does not extend it. Then the connection is
closed (there is no request yet to answer). The head's size is bounded by h11 already
(``h11_max_incomplete_event_size``, 16 KiB by default).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s: float = 20.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # no complete request head yet
            self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info(
                "closing a connection from %s: no complete request head in %g s", self.client, self.header_timeout_s
            )
            self.transport.close()


def h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})
