"""Request models of the OpenAI-compatible API (pydantic), and their conversion to SamplingParams.

Unknown fields are ignored, as OpenAI does; known fields are validated strictly (a string where
a number belongs is a 400 naming the field, never a silent coercion; booleans also take vLLM's
string spellings, see ``protocol_base``). vLLM fields this server cannot honour are refused with
a 400 that says so (``UNSUPPORTED_FIELDS``), never silently ignored. Range checks live in
``SamplingParams`` so the offline and the HTTP API give the same messages.
Responses are built as plain dicts in ``serving_common`` (cheaper per streamed token).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedllm.entrypoints.chat_utils import render_chat
from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol_base import (
    INT64_MAX,
    INT64_MIN,
    LaxBool,
    OpenAIBaseModel,
    refuse_unsupported,
)
from pagedllm.entrypoints.openai.structured import ChatTool, NamedToolChoice, StructuredRequestMixin, ToolChoice
from pagedllm.entrypoints.openai.tool_calls import tool_choice_schema
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per request

# vLLM request fields this server refuses when set to anything but their default, and why.
UNSUPPORTED_FIELDS = {
    "prompt_embeds": "prompt embeddings are not supported by this server; send text or token ids",
    "logprob_token_ids": "logprobs for chosen token ids are not supported; use logprobs (top-k) instead",
    "repetition_detection": "repetition detection is not supported by this server",
    "thinking_token_budget": "this server has no reasoning parser, so thinking_token_budget cannot be enforced",
    "watermarking": "watermarking is not supported by this server",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not supported by this server",
    "ec_transfer_params": "encoder-cache transfer is not supported by this server",
    "mm_processor_kwargs": "this server serves text-only models",
    "media_io_kwargs": "this server serves text-only models",
}


class StreamOptions(OpenAIBaseModel):
    include_usage: LaxBool | None = False
    continuous_usage_stats: LaxBool | None = False  # with include_usage: usage on every chunk too


class TextContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> TextContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(
                f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got type {self.type!r}"
            )
        return self


class ToolCallFunction(OpenAIBaseModel):
    name: str
    arguments: str


class AssistantToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIBaseModel):
    role: str = Field(min_length=1)  # OpenAI's roles, or a custom one the chat template knows
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an earlier assistant turn's calls

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content always a string."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            # Templates render arguments as objects (``tojson``): pass them parsed.
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _parse_arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return message


class _SamplingRequest(StructuredRequestMixin):
    """Fields shared by chat and completion requests (OpenAI's and vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, le=MAX_N)
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: LaxBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: LaxBool = False  # beam search of width n (best_of when set), as vLLM serves it
    length_penalty: float = 1.0  # beam search only; accepted without it, as vLLM accepts it
    min_tokens: int = 0
    ignore_eos: LaxBool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    skip_special_tokens: LaxBool = True
    spaces_between_special_tokens: LaxBool = True
    include_stop_str_in_output: LaxBool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    return_token_ids: LaxBool | None = None
    return_tokens_as_token_ids: LaxBool | None = None  # None: the server's --return-tokens-as-token-ids
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    vllm_xargs: dict[str, Any] | None = None  # SamplingParams.extra_args

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_FIELDS)

    @model_validator(mode="after")
    def _check_stream_fields(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None:
            _check_logprobs_count("prompt_logprobs", self.prompt_logprobs)
            if self.stream and self.prompt_logprobs != 0:
                raise RequestParamError(
                    "prompt_logprobs are not available when stream is true; send the request without "
                    "stream, or drop prompt_logprobs",
                    "prompt_logprobs",
                )
        return self

    def _check_beam_search(self, logprobs: bool, constraint_param: str | None) -> None:
        """With use_beam_search, the fields a beam search cannot honour are a 400 naming them
        (``SamplingParams`` refuses the others: stop, penalties, min_tokens, ...)."""
        if not self.use_beam_search:
            return
        if logprobs:
            raise RequestParamError("logprobs are not supported with use_beam_search; drop logprobs", "logprobs")
        if constraint_param is not None:
            raise RequestParamError(
                f"{constraint_param}: a constrained output is not supported with use_beam_search; "
                f"drop {constraint_param} or use_beam_search",
                constraint_param,
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` with ``include_usage`` (as vLLM)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_kwargs(self, structured: StructuredOutputsParams | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            structured_outputs=structured,
            n=self.n,
            best_of=self.best_of,
            stop=self.stop,
            seed=self.seed,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            logit_bias=_parse_logit_bias(self.logit_bias),
            extra_args=self.vllm_xargs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        if self.use_beam_search:
            kwargs.update(use_beam_search=True, length_penalty=self.length_penalty)
        optional = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        kwargs.update({k: v for k, v in optional.items() if v is not None})  # None: the default
        return kwargs


class ChatTemplateRequest(OpenAIBaseModel):
    """What renders a conversation, shared by chat completions and ``/tokenize`` so both render it
    with the same function from the same fields (their ids agree)."""

    messages: list[ChatMessage]
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False  # the last message stays open; the model continues it
    add_special_tokens: LaxBool = False  # BOS on top of what the template writes
    chat_template: str | None = None  # needs a server started with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that render RAG documents
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"

    @model_validator(mode="after")
    def _generation_prompt_or_continue(self) -> ChatTemplateRequest:
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise RequestParamError(
                    "continue_final_message and add_generation_prompt cannot both be true: set "
                    "add_generation_prompt to false to continue the last message",
                    "continue_final_message",
                )
            self.add_generation_prompt = False  # implied: the model continues the last message
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """ "none", "auto", "required" or a named function (OpenAI's defaults)."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    @property
    def response_role(self) -> str:
        """The role of the reply: the assistant's, or the last message's when it is continued."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def _template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs``, plus ``reasoning_effort`` and the ``enable_thinking`` it
        implies (as vLLM passes them, for templates that read them) unless the kwargs set them."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        implied = {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}
        return {**implied, **(self.chat_template_kwargs or {})}

    def render_chat(self, tokenizer: Any, chat_template: str | None) -> tuple[str, list[int]]:
        """The conversation as prompt text and ids (``chat_utils.render_chat``); tool_choice
        "none" leaves the tools out of the template. The rendered text holds the template's
        special tokens; ``add_special_tokens`` adds the tokenizer's on top."""
        tools = None
        if self.effective_tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
        text = render_chat(
            tokenizer,
            [m.to_template_dict() for m in self.messages],
            chat_template=self.chat_template or chat_template,
            tools=tools,
            documents=self.documents,
            chat_template_kwargs=self._template_kwargs(),
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )
        return text, list(tokenizer.encode(text, add_special_tokens=bool(self.add_special_tokens)))


class ChatCompletionRequest(_SamplingRequest, ChatTemplateRequest):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: LaxBool | None = False
    top_logprobs: int | None = None  # -1: every token of the vocabulary
    parallel_tool_calls: LaxBool | None = True
    echo: LaxBool = False  # the reply starts with the last message when it has the reply's role
    return_prompt_text: LaxBool | None = None  # the rendered prompt in the response

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            _check_logprobs_count("top_logprobs", self.top_logprobs)
            if self.top_logprobs and not self.logprobs:
                raise RequestParamError("top_logprobs needs logprobs set to true", "top_logprobs")
        return self

    @property
    def echo_text(self) -> str:
        """What ``echo`` puts before the reply: the last message, if it has the reply's role."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == self.response_role else ""

    def check_tool_choice(self) -> None:
        """RequestParamError (param tool_choice) for a choice the tools cannot satisfy."""
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise RequestParamError("tool_choice needs tools: pass the functions the model may call", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise RequestParamError(
                    f"tool_choice names the function {choice.function.name!r}, which is not in "
                    f"tools (available: {', '.join(names)})",
                    "tool_choice",
                )

    @property
    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` and ``logprobs`` the top count (vLLM's rule; the
        response then carries them). Not implied for a stream, which cannot carry them."""
        if self.prompt_logprobs is None and self.echo and not self.stream:
            return self.sample_logprobs
        return self.prompt_logprobs

    def to_sampling_params(self) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range values."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        structured, param = self.constraint()
        self._check_beam_search(bool(self.logprobs), param)
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=self.sample_logprobs,
            prompt_logprobs=self.effective_prompt_logprobs,
            **self._sampling_kwargs(structured),
        )

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint and the field it comes from: a forced tool call's schema, or one
        of the structured-output fields."""
        self.check_tool_choice()
        structured, param = self.structured_outputs_params()
        schema = tool_choice_schema(self.tools or [], self.effective_tool_choice, bool(self.parallel_tool_calls))
        if schema is None:
            return structured, param
        if structured is not None:
            raise RequestParamError(
                f"tool_choice {self.effective_tool_choice!r} already constrains the output; drop {param}", param
            )
        return StructuredOutputsParams(json=schema), "tools"


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo: return the prompt only
    logprobs: int | None = None  # -1: every token of the vocabulary
    echo: LaxBool | None = False
    add_special_tokens: LaxBool = True  # the tokenizer's BOS before a text prompt
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise ValueError("prompt must not be empty: pass a string, a list of strings or token ids")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported by this server; leave it unset")
        return suffix

    @model_validator(mode="after")
    def _check_logprobs(self) -> CompletionRequest:
        if self.logprobs is not None:
            _check_logprobs_count("logprobs", self.logprobs)
        if self.echo_only and self.min_tokens:
            raise RequestParamError(
                "min_tokens must be 0 with echo and max_tokens 0 (the prompt only, nothing generated)", "min_tokens"
            )
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt comes back and nothing is generated for it."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (a string or a list of token ids each)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # a list whose first item is an int: token ids
        return list(prompt)  # type: ignore[arg-type]  # list[str] | list[list[int]]

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs  # vLLM's rule: echo reports the prompt's logprobs too
        structured, param = self.constraint()
        self._check_beam_search(self.logprobs is not None, param)
        return SamplingParams(
            max_tokens=1 if self.echo_only else self.max_tokens,  # the one token is not returned
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            **self._sampling_kwargs(structured),
        )

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        return self.structured_outputs_params()


def _check_logprobs_count(name: str, value: int) -> None:
    if value < -1:
        raise RequestParamError(f"{name} must be -1 (the whole vocabulary) or a count >= 0, got {value}", name)


def _parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    bad = [key for key in bias if not key.strip().lstrip("-").isdigit()]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids (integers written as strings), got {bad[:5]}")
    return {int(key): value for key, value in bias.items()}


def _parse_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
