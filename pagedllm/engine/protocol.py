"""Messages between the front end (tokenize, detokenize, stop strings) and the engine core.

They are msgspec structs so the same objects cross a ZMQ socket unchanged when the engine
core runs in its own process. Over the socket every message is two frames: its kind (an
``EngineCoreRequestType`` or ``EngineCoreOutputType`` value) and the msgpack payload.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """Front end -> engine process: what the payload frame holds."""

    ADD = b"add"  # an EngineCoreRequest
    ABORT = b"abort"  # list[str]: request ids
    UTILITY = b"utility"  # (call_id, name, args): run EngineCoreProc.utility_<name>(*args) between steps
    CHECK_GRAMMAR = b"check_grammar"  # (call_id, StructuredOutputsParams): compile, answer with a UtilityResult
    SHUTDOWN = b"shutdown"  # empty: leave the busy loop


class EngineCoreOutputType(enum.Enum):
    """Engine process -> front end: what the payload frame holds."""

    OUTPUTS = b"outputs"  # EngineCoreOutputs of one step
    UTILITY = b"utility"  # a UtilityResult


class UtilityResult(msgspec.Struct, array_like=True):
    """The answer to a UTILITY or CHECK_GRAMMAR call. ``error``: the call itself failed. For
    CHECK_GRAMMAR, ``result`` is None when the constraint compiled, else why it is invalid."""

    call_id: int
    result: Any = None
    error: str | None = None


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or the engine
    ERROR = 3  # the engine could not serve it (stop_reason says why), e.g. a grammar that failed to compile

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized, validated request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # A pooling request: the engine embeds the prompt and ends it (sampling_params is unused).
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # Who sent it (the API key's name, never the key): the waiting queue serves tenants in turn.
    tenant: str | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs of several positions. Row i: column 0 is the chosen token, then the top-k."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]  # rank of the chosen token in the full distribution (1 = best)


class EngineCoreEventType(enum.IntEnum):
    """A moment in a request's life that only the engine core sees (for the latency metrics)."""

    QUEUED = 1  # handed to the scheduler
    SCHEDULED = 2  # admitted to the running batch (again after each preemption)


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """``timestamp`` is the engine core's ``time.monotonic()``, as is ``EngineCoreOutputs.timestamp``."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None  # for prompt positions 1..n-1 (chunks arrive in order)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it; the message of an ERROR
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_draft_tokens: int = 0  # speculative decoding: proposals verified this step
    num_accepted_tokens: int = 0  # of those, accepted
    events: list[EngineCoreEvent] | None = None  # since the request's last output, oldest first
    pooling_output: bytes | None = None  # a pooling request's embedding: float32, little-endian

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding since the last snapshot (vLLM's ``spec_decode_*`` counters)."""

    num_drafts: int = 0  # requests that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []  # [j]: drafts accepted at position j

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        missing = num_draft_tokens - len(self.num_accepted_tokens_per_pos)
        if missing > 0:
            self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos + [0] * missing
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """A snapshot of the scheduler, for metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_deferred_reqs: int = 0  # of the waiting, those blocked on their grammar, not on capacity
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0  # this step
    num_scheduled_tokens: int = 0  # tokens the model computed this step; 0 when no model step ran
    kv_swap_out_blocks: int = 0  # evicted prefix-cache blocks copied to the swap tier this step
    kv_swap_in_blocks: int = 0  # tier hits copied back into KV blocks this step
    spec_decoding: SpecDecodingStats | None = None  # None when speculation is off or idle
    # LoRA adapter name -> its running / waiting requests (empty without LoRA adapters in use)
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything one engine step sends back to the front end."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    engine_index: int = 0  # which data-parallel engine core (the front end stamps it on receipt)
