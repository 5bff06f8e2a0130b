"""Helpers shared by the chat and completion handlers: ids, usage, SSE, engine streams,
client-disconnect handling, the handler base class (errors are in ``errors.py``).

Engine generators are always driven by tasks of our own (``OutputStream``), never directly by
the HTTP handler or the response body: when a client goes away the server cancels those, and
cancelling our pump tasks from there makes ``AsyncLLM.generate`` abort its request in a task that
no cancel scope keeps re-cancelling, so the abort message always reaches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pagedllm.beam_search import beam_search_params, check_beam_width
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.beam_search_driver import beam_search
from pagedllm.entrypoints.openai.auth import quota_ticket
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.errors import (
    RequestParamError,
    error_body,
    server_error_response,
    value_error_response,
)
from pagedllm.entrypoints.openai.quotas import Ticket, reserve_prompts
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

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
def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with ``cached_tokens``, the prompt tokens served from the prefix
    cache under OpenAI's name (``prompt_tokens_details.cached_tokens``) and vLLM's
    (``cache_read_input_tokens``)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        usage["cache_read_input_tokens"] = cached_tokens
    return usage


class UsageCounter:
    """Token counts of a request with several prompts and n choices each; per choice too, for
    ``stream_options.continuous_usage_stats``."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.choice_tokens: dict[tuple[int, int], int] = {}  # (prompt index, choice index) -> tokens

    def add_prompt(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids or ())
        self.cached_tokens[prompt_index] = max(self.cached_tokens.get(prompt_index, 0), output.num_cached_tokens)

    def add(self, prompt_index: int, output: RequestOutput, completions: list[CompletionOutput] | None = None) -> None:
        """Count ``output``; ``completions``: what the client sees of its outputs, if not all."""
        self.add_prompt(prompt_index, output)
        for c in output.outputs if completions is None else completions:
            key = (prompt_index, c.index)
            self.choice_tokens[key] = self.choice_tokens.get(key, 0) + len(c.token_ids)

    def choice_usage(self, prompt_index: int, choice_index: int) -> dict:
        """One choice's usage so far (the continuous usage stats of its chunks)."""
        return make_usage(
            self.prompt_tokens.get(prompt_index, 0), self.choice_tokens.get((prompt_index, choice_index), 0)
        )

    def usage(self) -> dict:
        return make_usage(
            sum(self.prompt_tokens.values()), sum(self.choice_tokens.values()), sum(self.cached_tokens.values())
        )


# ---------------------------------------------------------------------------------- engine streams
class OutputStream:
    """Drives several engine generators (one per prompt) in tasks; yields ``(prompt_index, output)``
    in arrival order. ``close()`` cancels the tasks, which aborts unfinished requests.
    ``final_only``: the generators yield only their finished output (beam searches), which a
    streaming response waits for before it starts (:meth:`prefetch`)."""

    def __init__(self, generators: list[AsyncIterator[RequestOutput]], final_only: bool = False) -> None:
        self.final_only = final_only
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

    async def prefetch(self) -> None:
        """Wait for every output (raising the first error), to be read from :meth:`batches`."""
        ready = [got async for batch in self.batches() for got in batch]
        self._buffer = ready

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
    as soon as it hangs up, so its request is aborted at once. The watch waits on the ASGI
    receive channel (the server signals the hang-up there) rather than polling: a few hundred
    waiting requests would otherwise wake the event loop thousands of times a second."""
    task = _spawn(awaitable)
    watch = _spawn(_hang_up(raw_request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        task.cancel()
        watch.cancel()


async def _hang_up(raw_request: Request) -> None:
    """Returns when the client disconnects. The handler has read the whole body by now, so the
    channel carries nothing else the handler needs."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


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


def token_text(token_id: int, entry: Logprob | None, as_ids: bool = False) -> str:
    """A token as logprobs show it: its text, or ``token_id:N`` (``return_tokens_as_token_ids``,
    or when the request asked for no detokenization)."""
    if as_ids or entry is None or entry.decoded_token is None:
        return f"token_id:{token_id}"
    return entry.decoded_token


def prompt_logprobs_json(rows: PromptLogprobs | None) -> list[dict[str, dict] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id:
    {logprob, rank, decoded_token}} for the prompt's token and the top alternatives."""
    if rows is None:
        return None
    return [
        None
        if row is None
        else {
            str(t): {"logprob": clamp_logprob(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for t, e in row.items()
        }
        for row in rows
    ]


def echo_only_view(completion: CompletionOutput) -> CompletionOutput:
    """``echo`` with ``max_tokens`` 0: the one token the engine had to generate is not shown."""
    return dataclasses.replace(
        completion, text="", token_ids=[], logprobs=[] if completion.logprobs is not None else None
    )


# ---------------------------------------------------------------------------------- handler base
class OpenAIServing:
    """What both handlers do around their own request parsing and response shapes."""

    prompt_param = "prompt"  # the field a prompt-length error names
    id_prefix = "cmpl"  # of response ids

    def __init__(self, engine: EngineClient, models: ServedModels, return_tokens_as_token_ids: bool = False) -> None:
        self.engine = engine
        self.models = models
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # --return-tokens-as-token-ids

    def as_ids(self, request: Any) -> bool:
        """Whether logprobs show tokens as ``token_id:N`` (the request's choice, else the server's)."""
        choice = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if choice is None else bool(choice)

    def response_id(self, request: Any) -> str:
        """The response's ``id``: from the request's ``request_id`` when it sets one (as vLLM). The
        engine's ids stay random, so two requests with the same ``request_id`` never collide."""
        if request.request_id:
            return f"{self.id_prefix}-{request.request_id}"
        return random_id(self.id_prefix)

    def bad_request(self, exc: ValueError, request: BaseModel) -> JSONResponse:
        """The 400 for ``exc`` about ``request`` (a handler may rename the field it names)."""
        return value_error_response(exc, request, self.prompt_param)

    async def check_constraint(self, params: Any, param: str | None) -> None:
        """Compile the request's output constraint before anything streams: an invalid one, or one
        that does not compile in time, is a 400 naming ``param`` (the field it came from). A beam
        search wider than the engine's logprobs cap is a 400 naming ``n`` too."""
        if params.use_beam_search:
            self._check_beam_width(params.beam_width)
        try:
            await self.engine.check_structured_outputs(params)
        except ValueError as exc:
            raise RequestParamError(f"{param}: {exc}" if param else str(exc), param) from None

    def _check_beam_width(self, width: int) -> None:
        try:
            check_beam_width(width, self.engine.config.model_config.max_logprobs, "n", "--max-logprobs N")
        except ValueError as exc:
            raise RequestParamError(str(exc), "n") from None

    def start(self, prompts: list[Any], params: Any, request: Any, raw_request: Request | None = None) -> OutputStream:
        """Run the request: one engine request per prompt, or with ``use_beam_search`` one beam
        search per prompt (its steps' requests are the search's own). With API keys on, the
        key's quota ticket reserves its tokens (QuotaExceeded: a 429) and meters what each prompt
        uses; the engine gets the key's name as the tenant, and its priority (see ``_priority``)."""
        request_id = random_id(self.id_prefix)
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        ticket = quota_ticket(raw_request.state) if raw_request is not None else None
        options: dict[str, Any] = dict(priority=self._priority(request.priority, ticket), cache_salt=request.cache_salt)
        if ticket is not None:
            model_config = self.engine.config.model_config
            prompts, charges = reserve_prompts(
                ticket, prompts, params, self.engine.tokenizer, model_config.max_model_len
            )
            options["tenant"] = ticket.key.name
        lora = self.models.lora_request(request.model)
        if lora is not None:
            if params.use_beam_search:
                raise RequestParamError("beam search with a LoRA adapter is not supported", "use_beam_search")
            options["lora_request"] = lora
        if params.use_beam_search:
            search = beam_search_params(params, self.engine.config.model_config.max_model_len, params.temperature)
            searches = [beam_search(self.engine, p, params, search, rid, **options) for p, rid in zip(prompts, ids)]
            if ticket is not None:
                searches = [ticket.metered(c, s, delta=False) for c, s in zip(charges, searches)]
            return OutputStream(searches, final_only=True)
        generators = [
            self.engine.generate(p, params, rid, strict_max_tokens=True, **options) for p, rid in zip(prompts, ids)
        ]
        if lora is not None:
            generators = [self.models.tracked(lora.lora_name, g) for g in generators]
        if ticket is not None:
            delta = params.output_kind == RequestOutputKind.DELTA
            generators = [ticket.metered(c, g, delta) for c, g in zip(charges, generators)]
        return OutputStream(generators)

    def _priority(self, requested: int, ticket: Ticket | None) -> int:
        """Under the priority policy a key's ``priority`` is the most urgent its requests may be
        (lower runs first): a request may ask for less urgency, never for more. Under FCFS it is
        ignored (the start-up log says so)."""
        if ticket is None or self.engine.config.scheduler_config.policy != "priority":
            return requested
        return max(requested, ticket.key.priority)

    def failure_response(self, exc: Exception, request: BaseModel) -> Response:
        """A request that failed: the client hung up (499), bad input (400, OpenAI's error body),
        anything else (500)."""
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)
        if isinstance(exc, ValueError):
            return self.bad_request(exc, request)
        return server_error_response(exc)

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
                if stream.final_only:  # as vLLM: nothing streams before the final result
                    await until_disconnected(stream.prefetch(), raw_request)
                else:
                    await stream.wait_accepted()
                handed_over = True
                return sse_response(make_events(stream), stream)
            outputs = await until_disconnected(_collect(stream), raw_request)
            return JSONResponse(make_body(outputs))
        except Exception as exc:
            return self.failure_response(exc, request)
        finally:
            if not handed_over:
                stream.close()


async def _collect(stream: OutputStream) -> dict[int, RequestOutput]:
    """The final output of every prompt (requests run with RequestOutputKind.FINAL_ONLY)."""
    final: dict[int, RequestOutput] = {}
    async for batch in stream.batches():
        final.update(batch)
    return final
