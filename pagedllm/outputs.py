"""What the engine hands back to users: ``RequestOutput`` and its parts (vLLM's shapes).

These are plain dataclasses built by the front end's ``OutputProcessor``; nothing here knows
about tokenizers, the engine core or torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """The log probability of one token at one position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token at this position
    decoded_token: str | None = None  # None when the request asked for no detokenization


# One dict per generated token: {token_id: Logprob} for the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with ``n > 1`` has several)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless logprobs were requested
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={_short(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_short(self.logprobs)}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """Timestamps of one request, all ``time.monotonic()`` values; None until known."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: steps that verified proposals, proposals verified, and accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Share of verified proposals that were accepted (None without speculation)."""
        if not self.spec_num_draft_tokens:
            return None
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verifying step: the accepted proposals plus the sampled one."""
        if not self.spec_num_drafts:
            return None
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """Everything reported for one request at one point in time."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_short(self.prompt_token_ids)}, "
            f"prompt_logprobs={_short(self.prompt_logprobs)}, outputs={self.outputs!r}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens})"
        )


def _short(items: Sequence | None, limit: int = 8) -> str:
    """A list's repr, cut after ``limit`` items so long prompts don't flood a log line."""
    if items is None or len(items) <= limit:
        return repr(items)
    head = ", ".join(repr(x) for x in items[:limit])
    return f"[{head}, ... ({len(items)} total)]"


@dataclass
class PoolingOutput:
    """A pooling request's result: the embedding as float32 bytes (``data`` makes a tensor)."""

    raw: bytes

    @property
    def data(self) -> torch.Tensor:
        """The embedding as a 1-D float32 tensor (vLLM's ``PoolingOutput.data``)."""
        import torch

        return torch.frombuffer(bytearray(self.raw), dtype=torch.float32)

    @property
    def embedding(self) -> list[float]:
        return array("f", self.raw).tolist()

    def __repr__(self) -> str:
        return f"PoolingOutput(embedding={_short(self.embedding)})"


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: the embedding as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(embedding={_short(self.embedding)})"


@dataclass
class PoolingRequestOutput:
    """Everything reported for one pooling request; ``outputs`` is None when it did not finish
    with an embedding (aborted, or ``finish_reason`` "error" with ``error`` saying why)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt: ``outputs.embedding`` is a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        if output.outputs is None:
            raise ValueError(f"request {output.request_id} has no embedding: {output.error or output.finish_reason}")
        return cls(output.request_id, EmbeddingOutput(output.outputs.embedding), output.prompt_token_ids)
