"""The base of every request model: unknown fields ignored (as OpenAI does), known fields
validated strictly except booleans, which also take the strings and numbers vLLM's lax models
accept ("true"/"false", "1"/"0", "yes"/"no", "on"/"off"), so clients that send form-style
booleans work unchanged. A string where a number belongs is still a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

LaxBool = Annotated[bool, Field(strict=False)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and priorities: vLLM's signed 64-bit range


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
