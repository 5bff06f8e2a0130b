"""Request: the one owner of a request's state inside the engine core (torch-free)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from pagedllm.engine.protocol import EngineCoreRequest, FinishReason
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.kv_cache.hashing import BlockHash


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # queued, but its grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # e.g. its grammar failed to compile

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Token state of one sequence: prompt + output, and how much of it has KV in the cache."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.pooling_params = pooling_params  # a pooling request: it ends when its prompt is computed
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        self.tenant = tenant  # who sent it (an API key's name); the waiting queue serves tenants in turn
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1 = not looked up yet
        self.num_preemptions = 0
        # Scheduled batches whose results have not come back yet (pipeline stages keep several in
        # flight): while any, its next token is unknown and its blocks are not free to take.
        self.num_in_flight = 0
        # Content hashes of the full blocks of all_token_ids, kept up to date by the KV manager.
        self.block_hashes: list[BlockHash] = []
        self.max_tokens = sampling_params.max_tokens
        # Draft tokens proposed after the last step, verified in the next one (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Grammar state (pagedllm.structured_output.StructuredOutputRequest) when constrained.
        self.structured_output: Any = None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.priority,
            req.cache_salt,
            req.pooling_params,
            req.lora_request,
            req.tenant,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """What the scheduler catches ``num_computed_tokens`` up with: proposals count as tokens."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and MEAN/CLS pooling read every prompt position's output, which a
        prefix-cache hit would skip."""
        if self.sampling_params.prompt_logprobs is not None:
            return True
        return self.pooling_params is not None and self.pooling_params.needs_every_position

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
