"""POST /v1/chat/completions: render the chat template to token ids, generate, shape the reply."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.errors import RequestParamError, value_error_response
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatTemplateRequest
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIServing,
    OutputStream,
    UsageCounter,
    clamp_logprob,
    now_s,
    random_id,
    sse,
    token_text,
)
from pagedllm.entrypoints.openai.tool_calls import NamedToolCall, RequiredToolCalls, ToolCallExtractor
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    prompt_param = "messages"

    def __init__(
        self,
        engine: EngineClient,
        models: ServedModels,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        """``chat_template``: the template itself (``--chat-template`` already read), None: the
        tokenizer's. ``tool_call_parser``: how ``tool_choice: "auto"`` finds calls in the text
        (None: "auto" is refused, as vLLM does without --enable-auto-tool-choice)."""
        super().__init__(engine, models)
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        try:
            params = request.to_sampling_params()
            self._check_auto_tools(request)
            prompt_ids = self.render(request)
            await self.check_constraint(params, request.constraint()[1])
        except ValueError as exc:
            return value_error_response(exc, request, self.prompt_param)
        request_id = random_id("chatcmpl")
        stream = self.start([{"prompt_token_ids": prompt_ids}], params, request_id, request)
        shape = _ChatShape(request, request_id, self.tool_call_parser)
        return await self.respond(stream, raw_request, request, bool(request.stream), shape.events, shape.body)

    def _check_auto_tools(self, request: ChatCompletionRequest) -> None:
        if request.effective_tool_choice == "auto" and self.tool_call_parser is None:
            raise RequestParamError(
                'tool_choice "auto" (the default when tools are given) needs a server started '
                "with --enable-auto-tool-choice --tool-call-parser NAME; or pass tool_choice "
                '"required", "none" or a named function',
                "tool_choice",
            )

    def render(self, request: ChatTemplateRequest) -> list[int]:
        """The conversation as the prompt ids this handler sends (``/tokenize`` renders with the
        same function); the rendered template already holds BOS."""
        return request.render_chat_ids(self.engine.tokenizer, self.chat_template)


class _ChatShape:
    """Builds one request's response body or SSE chunks from engine outputs."""

    def __init__(self, request: ChatCompletionRequest, request_id: str, tool_call_parser: str | None = None) -> None:
        self.request = request
        self.num_top = request.top_logprobs or 0
        self.base = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": request.model}
        self.tool_call_parser = tool_call_parser
        self.extractors: dict[int, ToolCallExtractor | None] = {}  # by choice index, while streaming

    def _extractor(self) -> ToolCallExtractor | None:
        choice = self.request.effective_tool_choice
        if choice == "none" or (choice == "auto" and self.tool_call_parser is None):
            return None
        if choice == "auto":
            assert self.tool_call_parser is not None  # checked just above
            return TOOL_PARSERS[self.tool_call_parser]()
        if isinstance(choice, str):
            return RequiredToolCalls()  # "required"
        return NamedToolCall(choice.function.name)

    def body(self, outputs: dict[int, RequestOutput]) -> dict:
        output = outputs[0]
        usage = UsageCounter()
        usage.add(0, output)
        choices = [self._choice(c) for c in output.outputs]
        return {**self.base, "object": "chat.completion", "choices": choices, "usage": usage.usage()}

    def _choice(self, completion: CompletionOutput) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        finish_reason = completion.finish_reason
        extractor = self._extractor()
        forced = self.request.effective_tool_choice != "auto"
        if extractor is not None and (finish_reason == "stop" or not forced):
            content, calls = extractor.extract(completion.text)
            if calls:
                message.update(content=content, tool_calls=calls)
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {
            "index": completion.index,
            "message": message,
            "logprobs": self._logprobs(completion),
            "finish_reason": finish_reason,
        }

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        usage = UsageCounter()
        yield "".join(self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.request.n))
        async for batch in stream.batches():
            events = []
            for _, output in batch:
                usage.add(0, output)
                for completion in output.outputs:
                    events.extend(self._completion_chunks(completion))
            if events:
                yield "".join(events)
        if self.request.include_usage:
            yield sse({**self.base, "choices": [], "usage": usage.usage()})

    def _completion_chunks(self, completion: CompletionOutput) -> list[str]:
        if completion.index not in self.extractors:
            self.extractors[completion.index] = self._extractor()
        extractor = self.extractors[completion.index]
        if extractor is not None:
            return self._tool_chunks(completion, extractor)
        chunks = []
        if completion.text or (self.request.logprobs and completion.token_ids):
            chunks.append(self._chunk(completion.index, {"content": completion.text}, self._logprobs(completion)))
        if completion.finish_reason is not None:
            chunks.append(self._chunk(completion.index, {}, finish_reason=completion.finish_reason))
        return chunks

    def _tool_chunks(self, completion: CompletionOutput, extractor: ToolCallExtractor) -> list[str]:
        """Content and tool-call deltas as the extractor finds them; logprobs ride on the first."""
        deltas = extractor.feed(completion.text) if completion.text else []
        if completion.finish_reason is not None:
            deltas += extractor.finish()
        logprobs = self._logprobs(completion) if completion.token_ids else None
        if logprobs is not None and not deltas:
            deltas = [{}]
        chunks = [self._chunk(completion.index, delta, logprobs if i == 0 else None) for i, delta in enumerate(deltas)]
        if completion.finish_reason is not None:
            finish_reason = completion.finish_reason
            if extractor.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            chunks.append(self._chunk(completion.index, {}, finish_reason=finish_reason))
        return chunks

    def _chunk(self, index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self.base, "choices": [choice]}
        if self.request.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _logprobs(self, completion: CompletionOutput) -> dict | None:
        if not self.request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.logprobs, completion.token_ids, self.num_top)


def chat_logprobs(rows: Iterable[dict[int, Logprob]], token_ids: list[int], num_top: int) -> dict:
    """Chat's ``logprobs``: one entry per sampled token with its top ``num_top`` alternatives."""
    content = []
    for token_id, row in zip(token_ids, rows):
        top = sorted(row.items(), key=lambda item: -item[1].logprob)[:num_top]
        content.append(
            {**_chat_token(token_id, row[token_id]), "top_logprobs": [_chat_token(t, entry) for t, entry in top]}
        )
    return {"content": content}


def _chat_token(token_id: int, entry: Logprob) -> dict:
    text = token_text(token_id, entry)
    return {"token": text, "logprob": clamp_logprob(entry.logprob), "bytes": list(text.encode("utf-8"))}
