"""Per-request grammar state inside the engine core (torch-free)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import KIND_LABELS, StructuredOutputGrammar


class StructuredOutputRequest:
    """A constrained request's compile future, then its matcher.

    ``poll`` is non-blocking: the scheduler calls it each step while the request waits for its
    grammar, and sets ``error`` when compiling failed or ran past the deadline.
    """

    __slots__ = ("params", "grammar", "error", "_future", "_deadline", "_new_grammar")

    def __init__(
        self,
        params: StructuredOutputsParams,
        future: cf.Future,
        new_grammar: Callable[[Any], StructuredOutputGrammar],
        timeout_s: float,
    ) -> None:
        self.params = params
        self.grammar: StructuredOutputGrammar | None = None
        self.error: str | None = None
        self._future = future
        self._deadline = time.monotonic() + timeout_s
        self._new_grammar = new_grammar

    @property
    def future(self) -> cf.Future:
        return self._future

    def poll(self, now: float | None = None) -> bool:
        """True once the matcher exists; False while compiling or after a failure (see ``error``)."""
        if self.grammar is not None:
            return True
        if self.error is not None:
            return False
        if self._future.done():
            return self._take_result()
        if (time.monotonic() if now is None else now) > self._deadline:
            label = KIND_LABELS.get(self.params.kind, self.params.kind)
            self.error = f"the {label} did not compile within the time limit; simplify it"
        return False

    def _take_result(self) -> bool:
        try:
            compiled = self._future.result()
        except Exception as exc:  # an invalid constraint fails this request only
            self.error = str(exc) or type(exc).__name__
            return False
        self.grammar = self._new_grammar(compiled)
        return True

    def accept(self, token: int) -> bool:
        assert self.grammar is not None, "a request samples only after its grammar is ready"
        return self.grammar.accept_token(token)

    def is_terminated(self) -> bool:
        return self.grammar is not None and self.grammar.is_terminated()
