"""Helpers shared by the chat and completion handlers: ids, usage, SSE, engine streams,
client-disconnect handling, the handler base class (errors are in ``errors.py``).

Engine generators are always driven by tasks of our own (``OutputStream``), never directly by
the HTTP handler or the response body: when a client goes away the server cancels those, and
cancelling our pump tasks from there makes ``AsyncLLM.generate`` abort its request in a task that
no cancel scope keeps re-cancelling, so the abort message always reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.errors import (
    RequestParamError,
    error_body,
    server_error_response,
    value_error_response,
)
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.outputs import Logprob, RequestOutput

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler checks that its client is still there
SSE_DONE = "data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0
_background: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------- usage
def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class UsageCounter:
    """Token counts of a request with several prompts and n choices each."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids or ())
        self.cached_tokens[prompt_index] = max(self.cached_tokens.get(prompt_index, 0), output.num_cached_tokens)
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def usage(self) -> dict:
        return make_usage(sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values()))


# ---------------------------------------------------------------------------------- engine streams
class OutputStream:
    """Drives several engine generators (one per prompt) in tasks; yields ``(prompt_index, output)``
    in arrival order. ``close()`` cancels the tasks, which aborts unfinished requests."""

    def __init__(self, generators: list[AsyncIterator[RequestOutput]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_running = len(generators)
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._tasks = [_spawn(self._pump(i, gen)) for i, gen in enumerate(generators)]

    async def _pump(self, index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in generator:
                self._queue.put_nowait((index, output))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    async def wait_accepted(self) -> None:
        """Let every request through the engine's intake, so a bad prompt or max_tokens becomes a
        400 before the stream starts; raise the first such error. The intake validates before
        its first await, and the pumps run before we resume (they were scheduled first)."""
        await asyncio.sleep(0)
        self._buffer.extend(self._drain())

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Outputs in arrival order, all that are ready at once (several steps' worth when the
        reader fell behind), so a slow client costs fewer writes, not more."""
        while True:
            ready = self._drain()
            if not ready:
                got = await self._next()
                if got is None:
                    return
                ready = [got, *self._drain()]
            yield ready

    async def _next(self) -> tuple[int, RequestOutput] | None:
        while self._num_running:
            got = self._take(*await self._queue.get())
            if got is not None:
                return got
        return None

    def _drain(self) -> list[tuple[int, RequestOutput]]:
        ready, self._buffer = self._buffer, []
        while not self._queue.empty():
            got = self._take(*self._queue.get_nowait())
            if got is not None:
                ready.append(got)
        return ready

    def _take(self, index: int, item: RequestOutput | Exception | None) -> tuple[int, RequestOutput] | None:
        if item is None:
            self._num_running -= 1
            return None
        if isinstance(item, Exception):
            raise item
        return index, item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


def _spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def until_disconnected(awaitable: Coroutine[Any, Any, Any], raw_request: Request) -> Any:
    """Await in a task while watching the client; raise ClientDisconnected (the task cancelled)
    when it hangs up, so its request is aborted within about one poll interval."""
    task = _spawn(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                raise ClientDisconnected()
    finally:
        task.cancel()


# ---------------------------------------------------------------------------------- SSE
def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(events: AsyncIterator[str], stream: OutputStream) -> StreamingResponse:
    """Stream ``events``; on an error mid-stream send an error event, always end with [DONE]."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), 500))
        except ValueError as exc:
            yield sse(error_body(str(exc), 400))
        except Exception as exc:
            logger.exception("stream failed")
            yield sse(error_body(f"{type(exc).__name__}: {exc}", 500))
        finally:
            stream.close()
        yield SSE_DONE

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


# ---------------------------------------------------------------------------------- logprobs
def clamp_logprob(value: float) -> float:
    """JSON has no -inf; OpenAI reports this floor instead."""
    return max(value, _MIN_LOGPROB)


def token_text(token_id: int, entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


# ---------------------------------------------------------------------------------- handler base
class OpenAIServing:
    """What both handlers do around their own request parsing and response shapes."""

    prompt_param = "prompt"  # the field a prompt-length error names

    def __init__(self, engine: EngineClient, models: ServedModels) -> None:
        self.engine = engine
        self.models = models

    async def check_constraint(self, params: Any, param: str | None) -> None:
        """Compile the request's output constraint before anything streams: an invalid one, or one
        that does not compile in time, is a 400 naming ``param`` (the field it came from)."""
        try:
            await self.engine.check_structured_outputs(params)
        except ValueError as exc:
            raise RequestParamError(f"{param}: {exc}" if param else str(exc), param) from None

    def start(self, prompts: list[Any], params: Any, request_id: str, request: Any) -> OutputStream:
        def generate(i: int, prompt: Any) -> AsyncIterator[RequestOutput]:
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            return self.engine.generate(
                prompt, params, rid, priority=request.priority, cache_salt=request.cache_salt, strict_max_tokens=True
            )

        return OutputStream([generate(i, p) for i, p in enumerate(prompts)])

    async def respond(
        self,
        stream: OutputStream,
        raw_request: Request,
        request: BaseModel,
        streaming: bool,
        make_events: Callable[[OutputStream], AsyncIterator[str]],
        make_body: Callable[[dict[int, RequestOutput]], dict],
    ) -> Response:
        """Stream SSE events or collect the outputs for one JSON body; map failures to errors."""
        handed_over = False
        try:
            if streaming:
                await stream.wait_accepted()
                handed_over = True
                return sse_response(make_events(stream), stream)
            outputs = await until_disconnected(_collect(stream), raw_request)
            return JSONResponse(make_body(outputs))
        except ClientDisconnected:
            return Response(status_code=499)
        except ValueError as exc:
            return value_error_response(exc, request, self.prompt_param)
        except Exception as exc:
            return server_error_response(exc)
        finally:
            if not handed_over:
                stream.close()


async def _collect(stream: OutputStream) -> dict[int, RequestOutput]:
    """The final output of every prompt (requests run with RequestOutputKind.FINAL_ONLY)."""
    final: dict[int, RequestOutput] = {}
    async for batch in stream.batches():
        final.update(batch)
    return final
