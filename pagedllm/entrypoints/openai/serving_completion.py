"""POST /v1/completions: text or token-id prompts (one or many), streaming and not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.errors import error_response, value_error_response
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIServing,
    OutputStream,
    UsageCounter,
    clamp_logprob,
    echo_only_view,
    now_s,
    prompt_logprobs_json,
    sse,
    token_text,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    prompt_param = "prompt"
    id_prefix = "cmpl"

    def __init__(
        self,
        engine: EngineClient,
        models: ServedModels,
        return_tokens_as_token_ids: bool = False,
        prompt_limit: tuple[int, str] = (256, "the default"),
    ) -> None:
        super().__init__(engine, models, return_tokens_as_token_ids)
        self.max_prompts, self.max_prompts_reason = prompt_limit  # ServerOptions.prompt_limit

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        if len(request.prompts()) > self.max_prompts:
            return error_response(
                f"prompt holds {len(request.prompts())} prompts; this server takes at most {self.max_prompts} in "
                f"one request ({self.max_prompts_reason}): split the batch into several requests",
                400,
                "prompt",
            )
        try:
            params = request.to_sampling_params()
            prompts = [self._engine_prompt(p, request) for p in request.prompts()]
            await self.check_constraint(params, request.constraint()[1])
            stream = self.start(prompts, params, request, raw_request)
        except ValueError as exc:
            return value_error_response(exc, request, self.prompt_param)
        shape = _CompletionShape(self.engine.tokenizer, request, self.response_id(request), self.as_ids(request))
        return await self.respond(stream, raw_request, request, bool(request.stream), shape.events, shape.body)

    def _engine_prompt(self, prompt: str | list[int], request: CompletionRequest) -> Any:
        """The prompt as the engine gets it: a text prompt to encode without the tokenizer's
        special tokens (``add_special_tokens`` false) is tokenized here, everything else by the
        engine's intake (which also truncates: ``truncate_prompt_tokens``)."""
        if isinstance(prompt, str) and not request.add_special_tokens:
            return {
                "prompt": prompt,
                "prompt_token_ids": self.engine.tokenizer.encode(prompt, add_special_tokens=False),
            }
        return prompt


class _CompletionShape:
    """Builds one request's response body or SSE events from engine outputs."""

    def __init__(self, tokenizer: Any, request: CompletionRequest, response_id: str, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.n = request.n
        self.as_ids = as_ids
        hidden = request.skip_special_tokens and request.logprobs is not None and not as_ids
        self.hidden_ids = frozenset(tokenizer.all_special_ids) if hidden else frozenset()
        self.base = {"id": response_id, "object": "text_completion", "created": now_s(), "model": request.model}

    def _visible(self, output: RequestOutput) -> list[CompletionOutput]:
        """What the client sees of the outputs (echo with max_tokens 0 hides the generated token)."""
        return [echo_only_view(c) for c in output.outputs] if self.request.echo_only else output.outputs

    def body(self, outputs: dict[int, RequestOutput]) -> dict:
        usage = UsageCounter()
        choices = []
        for prompt_index, output in sorted(outputs.items()):
            completions = self._visible(output)
            usage.add(prompt_index, output, completions)
            for completion in completions:
                choice = self._choice(prompt_index, output, completion, True, output.prompt_logprobs, self._offsets())
                # Keys even when not asked for (null), as vLLM's responses have them.
                choice = {"prompt_token_ids": None, "token_ids": None, **choice}
                choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
                choices.append(choice)
        return {**self.base, "choices": choices, "usage": usage.usage()}

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        usage = UsageCounter()
        offsets: dict[int, CompletionLogprobs] = {}  # by choice index; present once it has sent a chunk
        prompt_logprobs: dict[int, Any] = {}  # by prompt; they come once, with a prompt's first output
        extra: dict[str, Any] = {"usage": None} if self.request.include_usage else {}
        async for batch in stream.batches():
            events = []
            for prompt_index, output in batch:
                completions = self._visible(output)
                usage.add(prompt_index, output, completions)
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                for completion in completions:
                    index = prompt_index * self.n + completion.index
                    first = index not in offsets
                    echo = first and bool(self.request.echo)
                    if not (completion.text or completion.token_ids or completion.finish_reason or echo):
                        continue
                    choice = self._choice(
                        prompt_index,
                        output,
                        completion,
                        first,
                        prompt_logprobs.get(prompt_index),
                        offsets.setdefault(index, self._offsets()),
                    )
                    if self.request.continuous_usage:
                        extra = {"usage": usage.choice_usage(prompt_index, completion.index)}
                    events.append(sse({**self.base, "choices": [choice], **extra}))
            if events:
                yield "".join(events)
        if self.request.include_usage:
            yield sse({**self.base, "choices": [], "usage": usage.usage()})

    def _offsets(self) -> CompletionLogprobs:
        return CompletionLogprobs(self.hidden_ids, self.as_ids)

    def _choice(
        self,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        first: bool,
        prompt_logprobs: Any,
        offsets: CompletionLogprobs,
    ) -> dict:
        """One choice (or one chunk of it); ``first``: its first chunk, which carries the echoed
        prompt and, with ``return_token_ids``, the prompt's ids."""
        echo = bool(self.request.echo) and first
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self._logprobs(output, completion, prompt_logprobs if echo else None, offsets)
        choice = {
            "index": prompt_index * self.n + completion.index,
            "text": (self._prompt_text(output) if echo else "") + completion.text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if self.request.return_token_ids:
            if first:
                choice["prompt_token_ids"] = output.prompt_token_ids
            choice["token_ids"] = completion.token_ids
        return choice

    def _logprobs(
        self, output: RequestOutput, completion: CompletionOutput, prompt_logprobs: Any, offsets: CompletionLogprobs
    ) -> dict:
        """The choice's logprobs; with ``prompt_logprobs`` (echo's first chunk), the prompt's first."""
        result = None
        if prompt_logprobs is not None and output.prompt_token_ids:
            first_text = self.tokenizer.decode(output.prompt_token_ids[:1])
            result = offsets.format(prompt_logprobs, output.prompt_token_ids, first_text)
        return CompletionLogprobs.merge(result, offsets.format(completion.logprobs or [], completion.token_ids))

    def _prompt_text(self, output: RequestOutput) -> str:
        """The prompt as echo shows it: as sent, or the (truncated) ids decoded."""
        if output.prompt is not None and self.request.truncate_prompt_tokens is None:
            return output.prompt
        return self.tokenizer.decode(
            output.prompt_token_ids or [], skip_special_tokens=self.request.skip_special_tokens
        )


class CompletionLogprobs:
    """Completions' ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset); keeps the
    running text offset so streamed chunks continue where the last one ended."""

    def __init__(self, hidden_ids: frozenset[int] = frozenset(), as_ids: bool = False) -> None:
        self.offset = 0
        self.hidden_ids = hidden_ids  # special tokens the text leaves out: they take no offset
        self.as_ids = as_ids  # tokens shown as "token_id:N"

    def format(
        self, rows: Iterable[dict[int, Logprob] | None], token_ids: list[int], first_text: str | None = None
    ) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, row in zip(token_ids, rows):
            if row is None:  # the first prompt token: nothing predicts it
                text = token_text(token_id, None) if self.as_ids else first_text or ""
                logprob, top = None, None
            else:
                text = token_text(token_id, row[token_id], self.as_ids)
                logprob = clamp_logprob(row[token_id].logprob)
                top = {token_text(t, entry, self.as_ids): clamp_logprob(entry.logprob) for t, entry in row.items()}
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += 0 if token_id in self.hidden_ids else len(text)
        return out

    @staticmethod
    def merge(a: dict | None, b: dict) -> dict:
        return b if a is None else {key: a[key] + b[key] for key in a}
