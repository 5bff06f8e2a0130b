"""Request models of OpenAI's Responses API (``POST /v1/responses``) and their translation into a
chat completion body, so a response renders, samples and constrains exactly as chat does.

Input items become ``ChatMessage``s: messages (developer as system), ``function_call`` items as
the assistant's ``tool_calls``, ``function_call_output`` items as ``tool`` messages. Responses
fields this server cannot honour are refused by name (``UNSUPPORTED_RESPONSES_FIELDS`` and the
validators below), never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol import (
    AssistantToolCall,
    ChatMessage,
    TextContentPart,
    ToolCallFunction,
)
from pagedllm.entrypoints.openai.protocol_base import (
    INT64_MAX,
    INT64_MIN,
    LaxBool,
    OpenAIBaseModel,
    refuse_unsupported,
)

# Responses fields refused when set to anything but their default, and why.
UNSUPPORTED_RESPONSES_FIELDS = {
    "background": "background responses are not supported; leave background unset or false",
    "conversation": "conversation objects are not supported; continue with previous_response_id",
    "prompt": "stored prompt templates are not supported; send the input itself",
    "context_management": "context management (compaction) is not supported",
    "moderation": "moderation is not supported by this server",
}
_ITEM_TYPES = ("message", "function_call", "function_call_output")
_TEXT_PART_TYPES = ("input_text", "output_text")
_METADATA_LIMITS = (16, 64, 512)  # OpenAI's: pairs, key length, value length


class InputTextPart(OpenAIBaseModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> InputTextPart:
        if self.type not in _TEXT_PART_TYPES or self.text is None:
            raise ValueError(f"only text content parts (input_text, output_text) are supported, got type {self.type!r}")
        return self


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: LaxBool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: LaxBool | None = None  # always enforced

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.json_schema is None or not self.name):
            raise ValueError("a format of type json_schema needs name and schema (a JSON schema)")
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.json_schema, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, verbosity: str | None) -> str | None:
        if verbosity is not None:
            raise ValueError("verbosity is not supported (no model here reads it); leave it unset")
        return verbosity


class ReasoningConfig(OpenAIBaseModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @model_validator(mode="after")
    def _no_reasoning(self) -> ReasoningConfig:
        if self.effort not in (None, "none") or self.summary is not None or self.generate_summary is not None:
            raise ValueError(
                "reasoning is not supported: this server has no reasoning parser; leave reasoning unset "
                'or {"effort": "none"}'
            )
        return self


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: LaxBool | None = True
    text: TextConfig | None = None
    stream: LaxBool | None = False
    store: LaxBool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # vLLM's sampling extras
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: LaxBool = False
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_RESPONSES_FIELDS)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty: pass a string or a list of input items")
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = _item_type(item)
            if kind not in _ITEM_TYPES:
                raise ValueError(
                    f"input[{i}]: items of type {kind!r} are not supported; send messages, "
                    "function_call and function_call_output items"
                )
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported; only function tools are")
        return tools

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        pairs, key_len, value_len = _METADATA_LIMITS
        if metadata is not None and (
            len(metadata) > pairs or any(len(k) > key_len or len(v) > value_len for k, v in metadata.items())
        ):
            raise ValueError(
                f"metadata takes at most {pairs} pairs, keys of at most {key_len} and values of at most "
                f"{value_len} characters"
            )
        return metadata

    @model_validator(mode="after")
    def _refuse_unservable(self) -> ResponsesRequest:
        if self.truncation == "auto":
            raise RequestParamError(
                'truncation "auto" is not supported: an input over the context length is a 400; '
                'leave truncation unset or "disabled"',
                "truncation",
            )
        if self.include:
            raise RequestParamError(
                f"include {self.include} is not supported: this server returns no extra output data", "include"
            )
        if self.top_logprobs:
            raise RequestParamError(
                "top_logprobs is not supported by the Responses API here; leave it 0", "top_logprobs"
            )
        return self

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def text_format(self) -> TextFormat:
        return (self.text.format if self.text else None) or TextFormat(type="text")

    def chat_body(self, conversation: list[ChatMessage]) -> dict[str, Any]:
        """The chat completion body for ``conversation`` (earlier turns and this input), with the
        instructions as a system message first."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + conversation,
            "stream": bool(self.stream),
            "parallel_tool_calls": self.parallel_tool_calls,
            "ignore_eos": self.ignore_eos,
            "priority": self.priority,
        }
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "cache_salt": self.cache_salt,
            "user": self.user,
            "tools": [tool.chat_tool() for tool in self.tools] if self.tools else None,
            "tool_choice": self._chat_tool_choice(),
            "response_format": self.text_format.response_format() if self.text_format.type != "text" else None,
        }
        return {**body, **{k: v for k, v in optional.items() if v is not None}}

    def _chat_tool_choice(self) -> str | dict | None:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice


def to_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[ChatMessage]:
    """Input (or earlier output) items as chat messages: consecutive function calls join the
    assistant message before them; a call's output names the function it answers."""
    messages: list[ChatMessage] = []
    names = {item.call_id: item.name for item in items if isinstance(item, FunctionCallItem)}
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=_chat_content(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = AssistantToolCall(
                id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments)
            )
            if not messages or messages[-1].role != "assistant":
                messages.append(ChatMessage(role="assistant", content=""))
            messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
        else:
            content = _chat_content(item.output)
            messages.append(
                ChatMessage(role="tool", content=content, tool_call_id=item.call_id, name=names.get(item.call_id))
            )
    return messages


def _chat_content(content: str | list[InputTextPart]) -> str | list[TextContentPart]:
    if isinstance(content, str):
        return content
    return [TextContentPart(type="text", text=part.text) for part in content]
