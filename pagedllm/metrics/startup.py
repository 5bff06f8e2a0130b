"""Where start-up time goes: named phases, timed in order, summed up in one log line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupPhases:
    """``with phases.phase("weights"): ...`` records how long each step took, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def summary(self) -> str:
        """``weights 0.03 s, KV cache 0.00 s, ...``."""
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())
