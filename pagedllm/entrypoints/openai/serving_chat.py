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
    prompt_logprobs_json,
    sse,
    token_text,
)
from pagedllm.entrypoints.openai.tool_calls import NamedToolCall, RequiredToolCalls, ToolCallExtractor
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    prompt_param = "messages"
    id_prefix = "chatcmpl"

    def __init__(
        self,
        engine: EngineClient,
        models: ServedModels,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        return_tokens_as_token_ids: bool = False,
        trust_request_chat_template: bool = False,
    ) -> None:
        """``chat_template``: the template itself (``--chat-template`` already read), None: the
        tokenizer's. ``tool_call_parser``: how ``tool_choice: "auto"`` finds calls in the text
        (None: "auto" is refused, as vLLM does without --enable-auto-tool-choice).
        ``trust_request_chat_template``: accept a request's own ``chat_template``."""
        super().__init__(engine, models, return_tokens_as_token_ids)
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.trust_request_chat_template = trust_request_chat_template

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        try:
            params = request.to_sampling_params()
            self.check_auto_tools(request)
            prompt_text, prompt_ids = self.render(request)
            await self.check_constraint(params, request.constraint()[1])
            stream = self.start([{"prompt_token_ids": prompt_ids, "prompt": prompt_text}], params, request, raw_request)
        except ValueError as exc:
            return value_error_response(exc, request, self.prompt_param)
        shape = _ChatShape(request, self.response_id(request), self.tool_call_parser, self.as_ids(request))
        return await self.respond(stream, raw_request, request, bool(request.stream), shape.events, shape.body)

    def check_auto_tools(self, request: ChatCompletionRequest) -> None:
        if request.effective_tool_choice == "auto" and self.tool_call_parser is None:
            raise RequestParamError(
                'tool_choice "auto" (the default when tools are given) needs a server started '
                "with --enable-auto-tool-choice --tool-call-parser NAME; or pass tool_choice "
                '"required", "none" or a named function',
                "tool_choice",
            )

    def render(self, request: ChatTemplateRequest) -> tuple[str, list[int]]:
        """The conversation as the prompt text and ids this handler sends (``/tokenize`` renders
        with this same method); the rendered template already holds BOS."""
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise RequestParamError(
                "chat_template: this server does not run chat templates sent in requests; leave "
                "chat_template unset, or start the server with --trust-request-chat-template",
                "chat_template",
            )
        return request.render_chat(self.engine.tokenizer, self.chat_template)


class _ChatShape:
    """Builds one request's response body or SSE chunks from engine outputs."""

    def __init__(
        self, request: ChatCompletionRequest, response_id: str, tool_call_parser: str | None, as_ids: bool
    ) -> None:
        self.request = request
        self.num_top = request.top_logprobs or 0
        self.as_ids = as_ids
        self.role = request.response_role
        self.echo = request.echo_text
        self.base = {"id": response_id, "object": "chat.completion.chunk", "created": now_s(), "model": request.model}
        self.tool_call_parser = tool_call_parser
        self.extractors: dict[int, ToolCallExtractor | None] = {}  # by choice index, while streaming
        self.usage = UsageCounter()

    def _extractor(self) -> ToolCallExtractor | None:
        return tool_call_extractor(self.request, self.tool_call_parser)

    def _prompt_fields(self, output: RequestOutput) -> dict[str, Any]:
        """The prompt's ids (as the engine ran them: truncated, if asked) and rendered text,
        where the request asked for them."""
        fields: dict[str, Any] = {}
        if self.request.return_token_ids:
            fields["prompt_token_ids"] = output.prompt_token_ids
        if self.request.return_prompt_text:
            fields["prompt_text"] = output.prompt
        return fields

    def body(self, outputs: dict[int, RequestOutput]) -> dict:
        output = outputs[0]
        self.usage.add(0, output)
        choices = [self._choice(c) for c in output.outputs]
        body = {**self.base, "object": "chat.completion", "choices": choices, "usage": self.usage.usage()}
        body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)  # null unless asked for
        body["prompt_token_ids"] = None  # a key even when not asked for, as vLLM's responses have it
        return {**body, **self._prompt_fields(output)}

    def _choice(self, completion: CompletionOutput) -> dict:
        message: dict[str, Any] = {"role": self.role, "content": completion.text}
        finish_reason = completion.finish_reason
        extractor = self._extractor()
        forced = self.request.effective_tool_choice != "auto"
        if extractor is not None and (finish_reason == "stop" or not forced):
            content, calls = extractor.extract(completion.text)
            if calls:
                message.update(content=content, tool_calls=calls)
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        choice = {
            "index": completion.index,
            "message": message,
            "logprobs": self._logprobs(completion),
            "finish_reason": finish_reason,
            "stop_reason": completion.stop_reason,
        }
        choice["token_ids"] = completion.token_ids if self.request.return_token_ids else None
        return choice

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        opened = False
        async for batch in stream.batches():
            events = []
            for _, output in batch:
                if not opened:
                    self.usage.add_prompt(0, output)
                    events.extend(self._opening_chunks(output))
                    opened = True
                self.usage.add(0, output)
                for completion in output.outputs:
                    events.extend(self._completion_chunks(completion))
            if events:
                yield "".join(events)
        if self.request.include_usage:
            yield sse({**self.base, "choices": [], "usage": self.usage.usage()})

    def _opening_chunks(self, output: RequestOutput) -> list[str]:
        """With the first output (as vLLM, which also waits for it): each choice's role with the
        prompt's ids and text where asked for, then the echoed message."""
        chunks = [
            {**self._chunk(i, {"role": self.role, "content": ""}), **self._prompt_fields(output)}
            for i in range(self.request.n)
        ]
        if self.echo:
            chunks += [self._chunk(i, {"content": self.echo}) for i in range(self.request.n)]
        return [sse(chunk) for chunk in chunks]

    def _completion_chunks(self, completion: CompletionOutput) -> list[str]:
        """The choice's new deltas; its logprobs and token ids ride on the first, the finish
        reason on the last (with the last token's text, as vLLM sends it)."""
        if completion.index not in self.extractors:
            self.extractors[completion.index] = self._extractor()
        extractor = self.extractors[completion.index]
        deltas = chat_deltas(completion.text, completion.finish_reason is not None, extractor)
        first: dict[str, Any] = {}
        if completion.token_ids:
            first["logprobs"] = self._logprobs(completion)
            if self.request.return_token_ids:
                first["token_ids"] = completion.token_ids
        if not deltas and (first.get("logprobs") or "token_ids" in first or completion.finish_reason):
            deltas = [{} if extractor is not None else {"content": ""}]  # vLLM's empty content delta
        chunks = [self._chunk(completion.index, delta, **(first if i == 0 else {})) for i, delta in enumerate(deltas)]
        if chunks and completion.finish_reason is not None:
            finish_reason = completion.finish_reason
            if extractor is not None and extractor.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            chunks[-1]["choices"][0].update(finish_reason=finish_reason, stop_reason=completion.stop_reason)
        return [sse(chunk) for chunk in chunks]

    def _chunk(self, index: int, delta: dict, logprobs: dict | None = None, **fields: Any) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None, **fields}
        chunk: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.request.continuous_usage:
            chunk["usage"] = self.usage.choice_usage(0, index)
        elif self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, completion: CompletionOutput) -> dict | None:
        if not self.request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.logprobs, completion.token_ids, self.num_top, self.as_ids)


def tool_call_extractor(request: ChatCompletionRequest, tool_call_parser: str | None) -> ToolCallExtractor | None:
    """What finds the tool calls in a choice's text: the server's parser for "auto", the forced
    call's reader for "required" or a named function, none for "none" (or "auto" without a parser)."""
    choice = request.effective_tool_choice
    if choice == "none" or (choice == "auto" and tool_call_parser is None):
        return None
    if choice == "auto":
        assert tool_call_parser is not None  # checked just above
        return TOOL_PARSERS[tool_call_parser]()
    if isinstance(choice, str):
        return RequiredToolCalls()  # "required"
    return NamedToolCall(choice.function.name)


def chat_deltas(text: str, finished: bool, extractor: ToolCallExtractor | None) -> list[dict]:
    """A choice's new text as chat deltas: content, or content and tool-call deltas as the
    extractor finds them (it flushes what it holds once the choice is ``finished``)."""
    if extractor is None:
        return [{"content": text}] if text else []
    deltas = extractor.feed(text) if text else []
    if finished:
        deltas += extractor.finish()
    return deltas


def chat_logprobs(rows: Iterable[dict[int, Logprob]], token_ids: list[int], num_top: int, as_ids: bool = False) -> dict:
    """Chat's ``logprobs``: one entry per sampled token with its top ``num_top`` alternatives
    (-1: all that were computed)."""
    content = []
    for token_id, row in zip(token_ids, rows):
        top = sorted(row.items(), key=lambda item: -item[1].logprob)
        if num_top >= 0:
            top = top[:num_top]
        content.append(
            {
                **_chat_token(token_id, row[token_id], as_ids),
                "top_logprobs": [_chat_token(t, entry, as_ids) for t, entry in top],
            }
        )
    return {"content": content}


def _chat_token(token_id: int, entry: Logprob, as_ids: bool) -> dict:
    text = token_text(token_id, entry, as_ids)
    return {"token": text, "logprob": clamp_logprob(entry.logprob), "bytes": list(text.encode("utf-8"))}
