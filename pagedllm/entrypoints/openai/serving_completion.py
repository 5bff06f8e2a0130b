"""POST /v1/completions: text or token-id prompts (one or many), streaming and not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import value_error_response
from pagedllm.entrypoints.openai.protocol import CompletionRequest
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
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    prompt_param = "prompt"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        try:
            params = request.to_sampling_params()
            await self.check_constraint(params, request.constraint()[1])
        except ValueError as exc:
            return value_error_response(exc, request, self.prompt_param)
        request_id = random_id("cmpl")
        stream = self.start(request.prompts(), params, request_id, request)
        shape = _CompletionShape(self.engine.tokenizer, request, request_id)
        return await self.respond(stream, raw_request, request, bool(request.stream), shape.events, shape.body)


class _CompletionShape:
    """Builds one request's response body or SSE events from engine outputs."""

    def __init__(self, tokenizer: Any, request: CompletionRequest, request_id: str) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.n = request.n
        hidden = request.skip_special_tokens and request.logprobs is not None
        self.hidden_ids = frozenset(tokenizer.all_special_ids) if hidden else frozenset()
        self.base = {"id": request_id, "object": "text_completion", "created": now_s(), "model": request.model}

    def body(self, outputs: dict[int, RequestOutput]) -> dict:
        usage = UsageCounter()
        choices = []
        for prompt_index, output in sorted(outputs.items()):
            usage.add(prompt_index, output)
            for completion in output.outputs:
                choices.append(
                    self._choice(
                        prompt_index,
                        output,
                        completion,
                        bool(self.request.echo),
                        output.prompt_logprobs,
                        CompletionLogprobs(self.hidden_ids),
                    )
                )
        return {**self.base, "choices": choices, "usage": usage.usage()}

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        usage = UsageCounter()
        offsets: dict[int, CompletionLogprobs] = {}  # by choice index; present once it has sent a chunk
        prompt_logprobs: dict[int, Any] = {}  # by prompt; they come once, with a prompt's first output
        extra = {"usage": None} if self.request.include_usage else {}
        async for batch in stream.batches():
            events = []
            for prompt_index, output in batch:
                usage.add(prompt_index, output)
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                for completion in output.outputs:
                    if not (completion.text or completion.token_ids or completion.finish_reason):
                        continue
                    index = prompt_index * self.n + completion.index
                    first = index not in offsets
                    choice = self._choice(
                        prompt_index,
                        output,
                        completion,
                        bool(self.request.echo) and first,
                        prompt_logprobs.get(prompt_index),
                        offsets.setdefault(index, CompletionLogprobs(self.hidden_ids)),
                    )
                    events.append(sse({**self.base, "choices": [choice], **extra}))
            if events:
                yield "".join(events)
        if self.request.include_usage:
            yield sse({**self.base, "choices": [], "usage": usage.usage()})

    def _choice(
        self,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        echo: bool,
        prompt_logprobs: Any,
        offsets: CompletionLogprobs,
    ) -> dict:
        """One choice (or one chunk of it); ``echo``: prepend the prompt (its first chunk only)."""
        prompt_text = self._prompt_text(output) if echo else ""
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self._logprobs(output, completion, prompt_logprobs if echo else None, offsets)
        return {
            "index": prompt_index * self.n + completion.index,
            "text": prompt_text + completion.text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
        }

    def _logprobs(
        self, output: RequestOutput, completion: CompletionOutput, prompt_logprobs: Any, offsets: CompletionLogprobs
    ) -> dict:
        result = None
        if prompt_logprobs is not None and output.prompt_token_ids:
            first_text = self.tokenizer.decode(output.prompt_token_ids[:1])
            result = offsets.format(prompt_logprobs, output.prompt_token_ids, first_text)
        return CompletionLogprobs.merge(result, offsets.format(completion.logprobs or [], completion.token_ids))

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(
            output.prompt_token_ids or [], skip_special_tokens=self.request.skip_special_tokens
        )


class CompletionLogprobs:
    """Completions' ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset); keeps the
    running text offset so streamed chunks continue where the last one ended."""

    def __init__(self, hidden_ids: frozenset[int] = frozenset()) -> None:
        self.offset = 0
        self.hidden_ids = hidden_ids  # special tokens the text leaves out: they take no offset

    def format(
        self, rows: Iterable[dict[int, Logprob] | None], token_ids: list[int], first_text: str | None = None
    ) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, row in zip(token_ids, rows):
            if row is None:  # the first prompt token: nothing predicts it
                text, logprob, top = first_text or "", None, None
            else:
                text = token_text(token_id, row[token_id])
                logprob = clamp_logprob(row[token_id].logprob)
                top = {token_text(t, entry): clamp_logprob(entry.logprob) for t, entry in row.items()}
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += 0 if token_id in self.hidden_ids else len(text)
        return out

    @staticmethod
    def merge(a: dict | None, b: dict) -> dict:
        return b if a is None else {key: a[key] + b[key] for key in a}
