"""Helpers shared by the chat and completion handlers: ids, errors, usage, SSE, engine streams,
client-disconnect handling, the handler base class.

Engine generators are always driven by tasks of our own (``OutputStream``), never directly by
the HTTP handler or the response body: when a client goes away the server cancels those, and
cancelling our pump tasks from there makes ``AsyncLLM.generate`` abort its request in a task that
no cancel scope keeps re-cancelling, so the abort message always reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.openai.errors import RequestParamError, error_body, error_response
from pagedllm.outputs import Logprob, RequestOutput

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler checks that its client is still there
SSE_DONE = "data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
T = TypeVar("T")
_background: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------- errors
def check_model(requested: str | None, served: list[str]) -> tuple[str, Response | None]:
    """The model name to report, or a 404 for a name this server does not serve."""
    if requested is None or requested in served:
        return requested or served[0], None
    return requested, error_response(f"The model `{requested}` does not exist.", 404, "model")


def validation_error_response(exc: ValidationError, body: Any) -> JSONResponse:
    """A pydantic error as a 400 naming the offending parameter."""
    errors = exc.errors(include_url=False)
    first = ([e for e in errors if e["type"] == "value_error"] or errors)[0]
    param = _param_from_loc(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if not param:  # a model-level check: its message starts with the field it is about
        param = _param_from_message(message, body)
    elif first["type"] != "value_error":
        message = _type_error_message(first, [e for e in errors if e["loc"][:1] == first["loc"][:1]], body)
    return error_response(message, 400, param)


def _type_error_message(first: dict, same_field: list[dict], body: Any) -> str:
    """'temperature: Input should be a valid number, got 'hot''; for a union (every branch
    failed), the whole value and the accepted shapes."""
    branches = sorted({str(e["loc"][1]) for e in same_field if len(e["loc"]) > 1 and isinstance(e["loc"][1], str)})
    if len(same_field) > 1 and branches:
        value = body.get(first["loc"][0]) if isinstance(body, dict) else first["input"]
        return f"{first['loc'][0]}: invalid value {_short_repr(value)}; expected one of: {', '.join(branches)}"
    return f"{_param_from_loc(first['loc'])}: {first['msg']}, got {_short_repr(first['input'])}"


def value_error_response(exc: ValueError, body: Any, prompt_param: str) -> JSONResponse:
    """An engine/SamplingParams ValueError as a 400; the message says what to change."""
    message = str(exc)
    param = exc.param if isinstance(exc, RequestParamError) else _param_from_message(message, body)
    if param is None:
        param = "max_tokens" if "max_tokens" in message else prompt_param if "prompt" in message else None
    if param == "max_tokens" and isinstance(body, dict) and body.get("max_completion_tokens") is not None:
        param = "max_completion_tokens"  # chat's newer name for it
    return error_response(message, 400, param)


def server_error_response(exc: Exception) -> JSONResponse:
    if not isinstance(exc, EngineDeadError):
        logger.exception("request failed", exc_info=exc)
    return error_response(f"{type(exc).__name__}: {exc}", 500)


def _param_from_loc(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_NAMES)]
    return ".".join(parts) or None


def _param_from_message(message: str, body: Any) -> str | None:
    """'temperature must be >= 0' -> 'temperature' (only names the request could carry)."""
    match = re.match(r"(\w+) ", message)
    known = {"max_tokens", "logprobs", "prompt_logprobs"} | (set(body) if isinstance(body, dict) else set())
    return match.group(1) if match and match.group(1) in known else None


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------- usage
def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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


def _spawn(coro: Awaitable[Any]) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def until_disconnected(awaitable: Awaitable[Any], raw_request: Request) -> Any:
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

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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

    def __init__(self, engine: Any, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)

    def parse(self, body: Any, model_cls: type[T]) -> tuple[T | None, Response | None]:
        """The request model and the model name, or the 400/404 to send back."""
        try:
            request = model_cls.model_validate(body)
        except ValidationError as exc:
            return None, validation_error_response(exc, body)
        model, error = check_model(request.model, self.served_model_names)
        request.model = model
        return request, error

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
            return self.engine.generate(prompt, params, rid, priority=request.priority,
                                        cache_salt=request.cache_salt, strict_max_tokens=True)

        return OutputStream([generate(i, p) for i, p in enumerate(prompts)])

    async def respond(self, stream: OutputStream, raw_request: Request, body: Any, streaming: bool,
                      make_events: Callable[[OutputStream], AsyncIterator[str]],
                      make_body: Callable[[dict[int, RequestOutput]], dict]) -> Response:
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
            return value_error_response(exc, body, self.prompt_param)
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
