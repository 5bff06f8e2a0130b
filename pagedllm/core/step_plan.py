"""One ``schedule()`` call's decisions, and the ``SchedulerOutput`` built from them (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.request import Request


@dataclass(frozen=True)
class PipelineShape:
    """``num_stages`` pipeline stages (more than one: the steps carry the sampled tokens to the
    stages that do not sample) and ``max_batches_in_flight`` batches the engine keeps running."""

    num_stages: int = 1
    max_batches_in_flight: int = 1


ONE_STAGE = PipelineShape()


@dataclass
class StepPlan:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    # Requests one batch may take: with k batches in flight (pipeline stages), about 1/k of them.
    max_seqs: int = 1 << 62
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed: set[str] = field(default_factory=set)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # A running request found no blocks, and the request to preempt for them was in a batch still
    # in flight: nothing waiting is admitted this step either.
    blocked: bool = False

    @property
    def is_full(self) -> bool:
        return len(self.num_scheduled_tokens) >= self.max_seqs

    @property
    def short_of_blocks(self) -> bool:
        return self.blocked or bool(self.preempted)

    def add(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = block_ids
        self.token_budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Undo ``add`` for a request preempted later in the same step."""
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.new_block_ids.pop(request.request_id)
        self.spec_tokens.pop(request.request_id, None)
        self.cached_reqs.remove(request)

    def take_spec_tokens(self, request: Request, num_new: int) -> None:
        """Move the proposals that fit this step's share into the plan; a smaller share (budget,
        chunk cap) verifies only a prefix of them, and the rest are dropped, never carried over."""
        num_spec = num_new - (request.num_tokens - request.num_computed_tokens)
        if num_spec > 0:
            self.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []


def build_scheduler_output(
    plan: StepPlan,
    requests: dict[str, Request],
    kv_cache_manager: KVCacheManager,
    finished_req_ids: set[str],
    send_token_ids: bool = False,
) -> SchedulerOutput:
    """The plan as the worker reads it. Call before the computed counts advance. ``send_token_ids``
    (pipeline stages): each running request's output tokens of the step go along too."""
    new_reqs = [
        NewRequestData(
            r.request_id,
            r.prompt_token_ids,
            r.sampling_params,
            plan.new_block_ids[r.request_id],
            r.num_computed_tokens,
            r.pooling_params,
            r.lora_request,
        )
        for r in plan.new_reqs
    ]
    cached = CachedRequestData()
    for r in plan.cached_reqs:
        resumed = r.request_id in plan.resumed
        block_ids = kv_cache_manager.get_block_ids(r.request_id) if resumed else plan.new_block_ids[r.request_id]
        cached.add(r.request_id, resumed, block_ids, r.num_computed_tokens)
    if send_token_ids:
        cached.new_token_ids = [
            _step_output_tokens(r, plan.num_scheduled_tokens[r.request_id]) for r in plan.cached_reqs
        ]
    swap_out, swap_in = kv_cache_manager.take_kv_copies()
    return SchedulerOutput(
        new_reqs,
        cached,
        dict(plan.num_scheduled_tokens),
        sum(plan.num_scheduled_tokens.values()),
        set(finished_req_ids),
        {r.request_id for r in plan.preempted},
        _structured_rows(plan, requests),
        scheduled_spec_decode_tokens=plan.spec_tokens,
        kv_swap_out=swap_out,
        kv_swap_in=swap_in,
        kv_block_copies=kv_cache_manager.take_block_copies(),
    )


def _step_output_tokens(request: Request, num_tokens: int) -> list[int]:
    """The output tokens among the ``num_tokens`` the request computes from its computed count:
    for a decode step, the token sampled last (which stages before the last have not seen)."""
    start = max(request.num_computed_tokens, request.num_prompt_tokens)
    return request.all_token_ids[start : request.num_computed_tokens + num_tokens]


def _structured_rows(plan: StepPlan, requests: dict[str, Request]) -> list[str]:
    """Constrained requests that sample this step (their computed count reaches their end)."""
    rows = []
    for req_id, num_tokens in plan.num_scheduled_tokens.items():
        request = requests[req_id]
        if request.structured_output is not None and request.num_computed_tokens + num_tokens == request.num_tokens:
            rows.append(req_id)
    return rows
