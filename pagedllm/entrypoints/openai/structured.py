"""Request fields that constrain the output: OpenAI's ``response_format`` and tools, vLLM's
``structured_outputs`` and its older ``guided_*`` spellings; turned into one
``StructuredOutputsParams`` with the name of the field it came from (for 400s that point at it).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol_base import LaxBool, OpenAIBaseModel
from pagedllm.sampling_params import StructuredOutputsParams

_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: LaxBool | None = None  # always enforced


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema (a JSON schema)")
        return self


class StructuredOutputsField(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field (set exactly one)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: LaxBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: LaxBool | None = None

    @model_validator(mode="after")
    def _valid_name(self) -> FunctionDefinition:
        if not _FUNCTION_NAME.match(self.name):
            raise ValueError(f"tools: function name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        return self


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredRequestMixin(OpenAIBaseModel):
    """The constraint fields shared by chat and completion requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's one constraint and the field it came from; RequestParamError if it sets
        several or an invalid one."""
        sources = self._constraint_sources()
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise RequestParamError(
                f"{sources[1][0]} conflicts with {sources[0][0]}: set only one of {names}", sources[1][0]
            )
        if not sources:
            return None, None
        param, kwargs = sources[0]
        try:
            return StructuredOutputsParams(**kwargs), param
        except ValueError as exc:
            message = str(exc)
            if param != "structured_outputs":  # "structured_outputs.choice must be ..." -> "guided_choice must be ..."
                message = re.sub(r"^structured_outputs(\.\w+)?", param, message)
            raise RequestParamError(message, param) from None

    def _constraint_sources(self) -> list[tuple[str, dict[str, Any]]]:
        sources: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None  # ResponseFormat's validator requires it
            sources.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            kwargs = {
                "json": so.json_,
                "json_object": so.json_object,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
            }
            sources.append(("structured_outputs", {k: v for k, v in kwargs.items() if v is not None}))
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                sources.append((name, {kind: getattr(self, name)}))
        return sources
