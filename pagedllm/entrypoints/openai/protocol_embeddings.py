"""The request body of ``POST /v1/embeddings`` (OpenAI's fields, plus vLLM's extras)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol_base import INT64_MAX, INT64_MIN, LaxBool, OpenAIBaseModel
from pagedllm.pooling_params import PoolingParams

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on the inputs of one request


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None  # -1: as many as the model takes
    add_special_tokens: LaxBool = True
    normalize: LaxBool | None = None  # None: the model's default
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_messages(cls, data: Any) -> Any:
        if isinstance(data, dict) and "messages" in data and "input" not in data:
            raise RequestParamError("messages is not supported on /v1/embeddings; pass the text as input", "messages")
        return data

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        items = value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty: pass a string, a list of strings or token ids")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input has {len(items)} items; pass at most {MAX_EMBEDDING_INPUTS} per request")
        for item in items:
            if len(item) == 0:
                raise ValueError("input must not contain an empty string or an empty list of token ids")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise ValueError("truncate_prompt_tokens must be -1 (as many as fit) or an integer >= 1")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input on its own: a string or a list of token ids."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)  # type: ignore[arg-type]

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(
            dimensions=self.dimensions,
            normalize=self.normalize,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


class ScoreRequest(OpenAIBaseModel):
    """vLLM's /score with an embedding model: the cosine similarity of text pairs. ``text_1``
    one text against each of ``text_2``, or two lists of equal length pairwise."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _not_empty(cls, value: str | list[str]) -> str | list[str]:
        texts = [value] if isinstance(value, str) else value
        if not texts or any(not t for t in texts):
            raise ValueError("must be a non-empty string or a non-empty list of non-empty strings")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"has {len(texts)} texts; pass at most {MAX_EMBEDDING_INPUTS} per request")
        return value

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], t) for t in second]
        if len(first) != len(second):
            raise RequestParamError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}; pass one text_1, or as many as text_2",
                "text_2",
            )
        return list(zip(first, second))


class RerankRequest(OpenAIBaseModel):
    """The Jina/Cohere rerank body vLLM serves: ``documents`` ranked by similarity to ``query``."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    top_n: int = Field(default=0, ge=0)  # 0: every document
    truncate_prompt_tokens: int | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None

    @field_validator("documents")
    @classmethod
    def _no_empty_document(cls, value: list[str]) -> list[str]:
        if any(not d for d in value):
            raise ValueError("documents must not contain an empty string")
        return value
