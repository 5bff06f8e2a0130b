"""The base of every request model: unknown fields ignored (as OpenAI does), known fields
validated strictly except booleans, which also take the strings and numbers vLLM's lax models
accept ("true"/"false", "1"/"0", "yes"/"no", "on"/"off"), so clients that send form-style
booleans work unchanged. A string where a number belongs is still a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import RequestParamError

LaxBool = Annotated[bool, Field(strict=False)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and priorities: vLLM's signed 64-bit range
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})  # what a lax boolean reads as false


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def is_unset(value: Any) -> bool:
    """A value that asks for nothing: absent, null, or false (in any spelling a lax boolean takes)."""
    if isinstance(value, str):
        return value.strip().lower() in _FALSE_STRINGS
    return value is None or value is False


def refuse_unsupported(data: Any, fields: dict[str, str]) -> Any:
    """A ``mode="before"`` validator's body: a raw request body that sets one of ``fields`` (name
    -> why it cannot be honoured) to anything but an unset value is a 400 naming it."""
    if isinstance(data, dict):
        for name, reason in fields.items():
            if not is_unset(data.get(name)):
                raise RequestParamError(f"{name} must be left unset: {reason}", name)
    return data
