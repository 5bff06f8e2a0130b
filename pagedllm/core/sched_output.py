"""What the scheduler tells the workers each step: plain data, no torch.

New requests travel in full once; after that only diffs (new block ids, computed counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """First time a request is scheduled: everything the worker needs to keep its own copy."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request: embed the prompt, sample nothing
    lora_request: LoRARequest | None = None  # the adapter its rows run with (None: the base model)


@dataclass
class CachedRequestData:
    """Requests the worker already knows, column-wise."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and comes back; ``new_block_ids`` is its whole new table.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline stages only (else empty): the output tokens each request computes this step. A
    # stage that does not sample learns the tokens the last stage drew from these.
    new_token_ids: list[list[int]] = field(default_factory=list)

    def add(self, req_id: str, resumed: bool, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (the worker keeps its own row order: input_batch.py).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step: workers drop their state.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Constrained requests that sample this step, in batch order; the engine core then sets
    # ``grammar_bitmask`` (a structured_output.manager.GrammarBitmask) with one row for each.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding: req_id -> the proposed tokens scheduled after its real ones (the
    # step verifies them); requests without proposals are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the most tokens the worker may propose for it after this step (adaptive
    # speculation backing off); absent: num_speculative_tokens.
    spec_token_limits: dict[str, int] = field(default_factory=dict)
    # Swap-tier copies as (block id, tier slot), run before the step's forward: every swap-out
    # (an evicted prefix-cache block, copied out before its block is reused), then every swap-in
    # (a tier hit copied into the fresh block that holds it now). Run even when ``is_empty``.
    kv_swap_out: list[tuple[int, int]] = field(default_factory=list)
    kv_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Copy-on-write prefix hits: (source block, destination block), run after the swap-outs.
    kv_block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_side_effects(self) -> bool:
        """An empty step the workers must still see: state to drop, or KV blocks to copy."""
        return bool(self.finished_req_ids or self.kv_swap_out or self.kv_swap_in or self.kv_block_copies)


@dataclass
class ModelRunnerOutput:
    """What the worker sends back after a step (plain Python data)."""

    # req_id -> tokens sampled this step ([] for a prefill chunk that did not reach the end);
    # with speculation, the accepted proposals followed by one sampled token.
    sampled_token_ids: dict[str, list[int]]
    # req_id -> logprobs rows of the sampled tokens (only requests that asked for them).
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> logprobs of this step's prompt positions (requests with prompt_logprobs).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> tokens proposed for the next step (speculative decoding; absent = none).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the finished embedding (float32 bytes) of a pooling request whose prompt ended this step.
    pooler_output: dict[str, bytes] = field(default_factory=dict)
    # req_id -> why the worker could not serve it this step (e.g. its LoRA adapter's files failed
    # to load): the scheduler finishes it with an error and drops its KV from the prefix cache.
    errors: dict[str, str] = field(default_factory=dict)


from pagedllm.engine.protocol import LogprobsLists  # noqa: E402  (type only; torch-free)
