"""Request models of the OpenAI-compatible API (pydantic), and their conversion to SamplingParams.

Unknown fields are ignored, as OpenAI does; known fields are validated strictly (a string where
a number belongs is a 400 naming the field, never a silent coercion). Range checks live in
``SamplingParams`` so the offline and the HTTP API give the same messages.
Responses are built as plain dicts in ``serving_common`` (cheaper per streamed token).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedllm.entrypoints.chat_utils import render_chat_ids
from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.structured import ChatTool, NamedToolChoice, StructuredRequestMixin, ToolChoice
from pagedllm.entrypoints.openai.tool_calls import tool_choice_schema
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # OpenAI's limit on choices per request
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


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
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an earlier assistant turn's calls

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content always a string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
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


class _SamplingRequest(OpenAIBaseModel, StructuredRequestMixin):
    """Fields shared by chat and completion requests (OpenAI's and vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_SEED_RANGE[0], le=_SEED_RANGE[1])
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_kwargs(self, structured: StructuredOutputsParams | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            structured_outputs=structured,
            n=self.n,
            stop=self.stop,
            seed=self.seed,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_parse_logit_bias(self.logit_bias),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
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
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """ "none", "auto", "required" or a named function (OpenAI's defaults)."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def render_chat_ids(self, tokenizer: Any, chat_template: str | None, add_special_tokens: bool = False) -> list[int]:
        """The conversation as prompt ids (``chat_utils.render_chat_ids``); tool_choice "none"
        leaves the tools out of the template."""
        tools = None
        if self.effective_tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
        return render_chat_ids(
            tokenizer,
            [m.to_template_dict() for m in self.messages],
            chat_template=chat_template,
            tools=tools,
            chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=self.add_generation_prompt,
            add_special_tokens=add_special_tokens,
        )


class ChatCompletionRequest(_SamplingRequest, ChatTemplateRequest):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: bool | None = True

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

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

    def to_sampling_params(self) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range values."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured, _ = self.constraint()
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self._sampling_kwargs(structured))

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
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
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

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (a string or a list of token ids each)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # a list whose first item is an int: token ids
        return list(prompt)  # type: ignore[arg-type]  # list[str] | list[list[int]]

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        structured, _ = self.constraint()
        return SamplingParams(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            **self._sampling_kwargs(structured),
        )

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        return self.structured_outputs_params()


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
