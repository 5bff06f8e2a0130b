"""Steps in flight between the engine core and worker processes (pipeline stages)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.core.sched_output import ModelRunnerOutput


class PendingStep:
    """A step sent to every rank; ``result()`` waits for it. Ranks answer in order, so the
    executor's ``collect`` takes the steps oldest first."""

    def __init__(self, collect: Callable[[int], ModelRunnerOutput], index: int) -> None:
        self._collect, self.index = collect, index

    def result(self) -> ModelRunnerOutput:
        return self._collect(self.index)


def reader_thread(conn: Connection) -> Callable[[], Any]:
    """Receive ``conn``'s messages on a daemon thread as they come; the returned call takes the
    next one (EOFError once the sender is gone). A stage sent its next steps while it computes
    thus never leaves the engine core blocked on a full pipe while the stage's answer waits."""
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):
            inbox.put(EOFError)

    threading.Thread(target=read, name="pagedllm-stage-inbox", daemon=True).start()

    def take() -> Any:
        message = inbox.get()
        if message is EOFError:
            raise EOFError
        return message

    return take
