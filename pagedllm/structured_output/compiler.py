"""Grammar compilation off the caller's thread: a small thread pool, a cache keyed by the
constraint, a time limit (torch-free; the backend is built lazily in a pool thread).

One ``GrammarCompiler`` serves an engine: offline, the front end's ``check`` rejects a bad or
too-slow constraint before the request reaches the in-process engine core, which shares the
compiler; in server mode the engine process's compiler answers the front end's ``check_grammar``
message. The engine core uses ``submit`` and polls the future from its step loop, so compiling
never blocks a step, and the cache means a checked constraint is not compiled again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import KIND_LABELS, StructuredOutputBackend

GrammarKey = tuple[str, str]
_CACHE_SIZE = 512  # compiled grammars kept (least recently used dropped first)


class GrammarTimeoutError(ValueError):
    def __init__(self, kind: str, timeout_s: float) -> None:
        self.kind = kind
        super().__init__(
            f"the {KIND_LABELS.get(kind, kind)} did not compile within {timeout_s:g} s "
            "(--structured-outputs-compile-timeout); simplify it"
        )


class GrammarCompiler:
    """Compiles constraints in background threads; identical constraints compile once."""

    def __init__(
        self, make_backend: Callable[[], StructuredOutputBackend], timeout_s: float, max_workers: int = 2
    ) -> None:
        self.timeout_s = timeout_s
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarKey, cf.Future] = OrderedDict()
        self._cache_lock = threading.Lock()

    # ------------------------------------------------------------------ compile
    def submit(self, params: StructuredOutputsParams) -> cf.Future:
        """The compiled grammar as a future (an existing one when this constraint was seen)."""
        key = params.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            self._evict()
        return future

    def _evict(self) -> None:
        while len(self._cache) > _CACHE_SIZE:
            oldest = next(iter(self._cache))
            if not self._cache[oldest].done():
                return  # keep in-flight compiles; the cache shrinks once they finish
            del self._cache[oldest]

    def _compile(self, key: GrammarKey) -> Any:
        return self.backend().compile(*key)

    def warm_up(self) -> None:
        """Build the backend in a pool thread now, so the first constrained request does not wait
        for it (servers call this at start-up; the offline engine builds it on first use)."""
        self._pool.submit(self.backend)

    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (loading the tokenizer info takes a moment)."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    self._backend = self._make_backend()
        return self._backend

    # ------------------------------------------------------------------ front-end checks
    def check(self, params: StructuredOutputsParams) -> None:
        """Compile now (or find it cached); raise ValueError if invalid or over the time limit."""
        future = self.submit(params)
        try:
            future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise GrammarTimeoutError(params.kind, self.timeout_s) from None

    async def acheck(self, params: StructuredOutputsParams) -> None:
        """``check`` without blocking the event loop; no await at all when the result is cached."""
        future = self.submit(params)
        if not future.done():
            done, _ = await asyncio.wait({asyncio.wrap_future(future)}, timeout=self.timeout_s)
            if not done:
                raise GrammarTimeoutError(params.kind, self.timeout_s)
        future.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
