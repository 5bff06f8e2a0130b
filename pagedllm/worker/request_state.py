"""What the worker remembers about every live request, and applying the scheduler's diffs to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker remembers about a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    # Appended in place as tokens are sampled: the sampling metadata holds this very list.
    output_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs_done: int = 0  # prompt positions already reported (a resumed request recomputes)
    # [k, V]: the distributions its pending proposals were drawn from (a draft model's random
    # draws); None for deterministic proposals or none.
    draft_probs: torch.Tensor | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (embedded, never sampled)
    lora_request: LoRARequest | None = None  # the adapter its rows run with (None: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def update_states(
    states: dict[str, CachedRequestState],
    sched: SchedulerOutput,
    make_generator: Callable[[int | None], torch.Generator | None],
) -> None:
    """Apply the scheduler's diffs to the worker's request states."""
    for req_id in sched.finished_req_ids:
        states.pop(req_id, None)
    for new in sched.scheduled_new_reqs:
        states[new.req_id] = CachedRequestState(
            new.req_id,
            list(new.prompt_token_ids),
            new.sampling_params,
            make_generator(new.sampling_params.seed),
            list(new.block_ids),
            new.num_computed_tokens,
            pooling_params=new.pooling_params,
            lora_request=new.lora_request,
        )
    cached = sched.scheduled_cached_reqs
    for req_id, resumed, block_ids, computed in zip(
        cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
    ):
        state = states[req_id]
        state.block_ids = list(block_ids) if resumed else state.block_ids + block_ids
        state.num_computed_tokens = computed


def newest_block(sched: SchedulerOutput) -> int:
    """The highest block id the step gives any request (-1: none)."""
    newest = max((max(new.block_ids, default=-1) for new in sched.scheduled_new_reqs), default=-1)
    return max(newest, max((max(ids, default=-1) for ids in sched.scheduled_cached_reqs.new_block_ids), default=-1))
