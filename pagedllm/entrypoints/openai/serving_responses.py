"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request becomes a ``ChatCompletionRequest`` (``ResponsesRequest.chat_body``), rendered by the
chat handler's ``render`` and sampled and constrained as chat would; the generated text goes
through chat's tool-call extractors, whose deltas ``_OutputBuilder`` turns into Responses output
items and their stream events. Finished responses are kept in a bounded in-memory LRU
(``ResponseStore``) for ``previous_response_id`` and ``GET``, unless ``store`` is false.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import OpenAIError, value_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.protocol_responses import INPUT_ITEMS, ResponsesRequest, to_messages
from pagedllm.entrypoints.openai.request_body import parse_body
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, chat_deltas, tool_call_extractor
from pagedllm.entrypoints.openai.serving_common import OpenAIServing, OutputStream, UsageCounter, sse
from pagedllm.entrypoints.openai.tool_calls import ToolCallExtractor
from pagedllm.outputs import RequestOutput

DEFAULT_STORE_SIZE = 1024
# Chat's field names as the Responses API spells them (in 400s).
_PARAM_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_param(param: str | None) -> str | None:
    """A chat field name (``response_format.json_schema``) as the Responses field it came from."""
    if param is None:
        return None
    head = param.split(".")[0]
    if head == "tools":
        return ".".join(param.split(".")[:2])
    return _PARAM_NAMES.get(head, param)


# ---------------------------------------------------------------------------------- store
@dataclass
class StoredResponse:
    body: dict  # the Response object as it was returned
    conversation: list[ChatMessage]  # every turn so far, this response's output last (no instructions)


class ResponseStore:
    """The last ``capacity`` stored responses, least recently used evicted first."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# ---------------------------------------------------------------------------------- handler
class OpenAIServingResponses(OpenAIServing):
    prompt_param = "input"
    id_prefix = "resp"

    def __init__(self, chat: OpenAIServingChat, store_size: int = DEFAULT_STORE_SIZE) -> None:
        """``chat``: the chat handler whose rendering (template, tool parser) responses share."""
        super().__init__(chat.engine, chat.models, chat.return_tokens_as_token_ids)
        self.chat = chat
        self.store = ResponseStore(store_size)

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        earlier = self._earlier_turns(request.previous_response_id)
        conversation = earlier + to_messages(request.items())
        chat_request = self._chat_request(request, conversation)
        try:
            params = chat_request.to_sampling_params()
            self.chat.check_auto_tools(chat_request)
            prompt_text, prompt_ids = self.chat.render(chat_request)
            await self.check_constraint(params, chat_request.constraint()[1])
            stream = self.start(
                [{"prompt_token_ids": prompt_ids, "prompt": prompt_text}], params, chat_request, raw_request
            )
        except ValueError as exc:
            return self.bad_request(exc, chat_request)
        extractor = tool_call_extractor(chat_request, self.chat.tool_call_parser)
        shape = _ResponseShape(request, extractor, self._keep(request, conversation))
        return await self.respond(stream, raw_request, chat_request, bool(request.stream), shape.events, shape.body)

    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"no stored response with id {response_id!r}", 404, "response_id")
        return stored.body

    def bad_request(self, exc: ValueError, request: BaseModel) -> JSONResponse:
        error = value_error(exc, request, self.prompt_param)
        return OpenAIError(str(exc), 400, responses_param(error.param)).response()

    def _earlier_turns(self, previous_response_id: str | None) -> list[ChatMessage]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise OpenAIError(
                f"previous response with id {previous_response_id!r} not found: it was never stored "
                f"(store: false), or it is older than the last {self.store.capacity} responses kept",
                404,
                "previous_response_id",
            )
        return list(stored.conversation)

    def _chat_request(self, request: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
        try:
            return parse_body(ChatCompletionRequest, request.chat_body(conversation))
        except OpenAIError as exc:
            raise OpenAIError(exc.message, exc.status, responses_param(exc.param)) from None

    def _keep(self, request: ResponsesRequest, conversation: list[ChatMessage]) -> Callable[[dict], None]:
        """The callback that stores a finished response (a no-op with ``store: false``)."""

        def keep(body: dict) -> None:
            if request.store:
                output = to_messages(INPUT_ITEMS.validate_python(body["output"]))
                self.store.put(body["id"], StoredResponse(body, conversation + output))

        return keep


# ---------------------------------------------------------------------------------- output
class _OutputBuilder:
    """Turns chat-style deltas (``{"content"}`` / ``{"tool_calls"}``) into Responses output items,
    returning the stream events (without sequence numbers) that build them."""

    def __init__(self, extractor: ToolCallExtractor | None) -> None:
        self.extractor = extractor
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being generated

    def feed(self, text: str, finished: bool) -> list[dict]:
        events: list[dict] = []
        for delta in chat_deltas(text, finished, self.extractor):
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        return events

    def close(self, status: str) -> list[dict]:
        """End the open item (an empty message if nothing was generated) with ``status``."""
        events = [] if self.items else self._open_message()
        return events + self._close_open(status)

    def _text(self, text: str) -> list[dict]:
        events = [] if self.open is not None and self.open["type"] == "message" else self._open_message()
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return events + [
            {"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text, "logprobs": []}
        ]

    def _call(self, call: dict) -> list[dict]:
        events: list[dict] = []
        arguments = call["function"].get("arguments") or ""
        if "id" in call:  # a new call
            events += self._close_open("completed")
            item = {
                "id": _item_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            events += self._add(item)
        assert self.open is not None and self.open["type"] == "function_call"
        if arguments:
            self.open["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": arguments})
        return events

    def _open_message(self) -> list[dict]:
        events = self._close_open("completed")
        content: list[dict] = []
        item = {
            "id": _item_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": content,
        }
        events += self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        content.append(dict(part))
        events.append({"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part})
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": copy.deepcopy(item)}
        ]

    def _close_open(self, status: str) -> list[dict]:
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            done = {**self._where(), "content_index": 0}
            events.append({"type": "response.output_text.done", **done, "text": part["text"], "logprobs": []})
            events.append({"type": "response.content_part.done", **done, "part": dict(part)})
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **self._where(),
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item})
        self.open = None
        return events

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}


class _ResponseShape:
    """One request's Response object, whole or as the stream of events that builds it."""

    def __init__(
        self, request: ResponsesRequest, extractor: ToolCallExtractor | None, keep: Callable[[dict], None]
    ) -> None:
        self.request = request
        self.output = _OutputBuilder(extractor)
        self.keep = keep
        self.usage = UsageCounter()
        self.sequence_number = 0
        self.base = _response_base(request)

    def body(self, outputs: dict[int, RequestOutput]) -> dict:
        output = outputs[0]
        self.usage.add(0, output)
        completion = output.outputs[0]
        self.output.feed(completion.text, finished=True)
        self.output.close(_item_status(completion.finish_reason))
        return self._finish(completion.finish_reason)

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        opening = {**self.base, "status": "in_progress"}
        yield self._emit({"type": "response.created", "response": opening}) + self._emit(
            {"type": "response.in_progress", "response": opening}
        )
        finish_reason = None
        async for batch in stream.batches():
            events = []
            for _, output in batch:
                self.usage.add(0, output)
                completion = output.outputs[0]
                finish_reason = completion.finish_reason or finish_reason
                events += self.output.feed(completion.text, finished=completion.finish_reason is not None)
            if events:
                yield "".join(self._emit(e) for e in events)
        events = self.output.close(_item_status(finish_reason))
        body = self._finish(finish_reason)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield "".join(self._emit(e) for e in events) + self._emit({"type": kind, "response": body})

    def _finish(self, finish_reason: str | None) -> dict:
        incomplete = finish_reason == "length"
        body = {
            **self.base,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "completed_at": None if incomplete else int(time.time()),
            "output": self.output.items,
            "usage": _usage(self.usage.usage()),
        }
        self.keep(body)
        return body

    def _emit(self, event: dict) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {event['type']}\n{sse(event)}"


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _response_base(request: ResponsesRequest) -> dict:
    """The Response fields known before generation: the request's settings, echoed."""
    tool_choice = request.tool_choice
    if tool_choice is None:
        tool_choice = "auto" if request.tools else "none"
    return {
        "id": _item_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "model": request.model,
        "output": [],
        "parallel_tool_calls": bool(request.parallel_tool_calls),
        "previous_response_id": request.previous_response_id,
        "reasoning": None,
        "store": bool(request.store),
        "temperature": request.temperature,
        "text": {"format": request.text_format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "top_p": request.top_p,
        "truncation": "disabled",
        "user": request.user,
        "background": False,
        "usage": None,
    }


def _usage(usage: dict) -> dict:
    """Chat's usage under the Responses names (``cache_write_tokens`` is not measured: 0)."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
